"""Bytes uploaded per round and final accuracy on digits, per kind of upload compression.

Runs the real ServerApp and ClientApp on the in-process engine for each variant of
``[compression]`` (none, QSGD at 8/4/2 bits, top-k with and without error feedback,
rand-k on a shared pattern) and, under secure aggregation, without compression and with
QSGD; reads each round's ``bytes_up``/``bytes_down`` and the final accuracy from the
store. Bytes count the array payloads of the messages (.npy headers included). Prints
human lines to stderr and one JSON object as the last stdout line.

    python benchmarks/compression.py            # the default scenario: 20 clients, 10 rounds
    python benchmarks/compression.py --quick    # 4 clients, 1 round, three variants
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario

VARIANTS: dict[str, list[str]] = {
    "none": [],
    "qsgd-8": ["compression.kind=qsgd", "compression.bits=8"],
    "qsgd-4": ["compression.kind=qsgd", "compression.bits=4"],
    "qsgd-2": ["compression.kind=qsgd", "compression.bits=2"],
    "topk-10%": ["compression.kind=topk", "compression.fraction=0.1"],
    "topk-10%-no-ef": ["compression.kind=topk", "compression.fraction=0.1",
                       "compression.error_feedback=false"],
    "topk-1%": ["compression.kind=topk", "compression.fraction=0.01"],
    "randk-10%": ["compression.kind=topk", "compression.fraction=0.1",
                  "compression.shared_pattern=true"],
    "secagg": ["secagg.enabled=true"],
    "secagg+qsgd-8": ["secagg.enabled=true", "compression.kind=qsgd", "compression.bits=8"],
}
QUICK_VARIANTS = ("none", "qsgd-4", "topk-10%")
FULL = ["federation.checkpoint_every=0"]  # the default scenario otherwise
QUICK = [*FULL, "federation.clients=4", "federation.rounds=1", "train.local_epochs=1"]


def run_variant(name: str, base: list[str], db: str) -> dict[str, Any]:
    config = load_scenario("default", [*base, *VARIANTS[name]])
    t0 = time.perf_counter()
    summary = run_simulation(config, engine="inprocess", db=db)
    wall = time.perf_counter() - t0
    with Store(db) as store:
        rounds = [r for r in store.rounds(summary["run_id"]) if r.round >= 1]
    per_round = [r.metrics.get("bytes_up") for r in rounds]
    return {"variant": name, "compression": config["compression"],
            "secagg_bits": config["secagg"]["bits"] if config["secagg"]["enabled"] else None,
            "rounds": len(rounds), "clients": config["federation"]["clients"],
            "bytes_up_total": summary["bytes_up"], "bytes_down_total": summary["bytes_down"],
            "bytes_up_per_round": summary["bytes_up"] / max(1, len(rounds)),
            "bytes_up_per_round_stored": per_round if None not in per_round else None,
            "final_accuracy": summary["final_accuracy"], "wall_s": round(wall, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    base, names = (QUICK, QUICK_VARIANTS) if args.quick else (FULL, tuple(VARIANTS))
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'compression.db'}"
        for name in names:
            results.append(run_variant(name, base, db))
            print(json.dumps(results[-1]), file=sys.stderr)
    dense = {r["variant"]: r["bytes_up_per_round"] for r in results}
    for r in results:
        reference = dense["secagg"] if r["variant"].startswith("secagg") else dense["none"]
        r["upload_ratio"] = round(reference / r["bytes_up_per_round"], 3)
    print(json.dumps({"benchmark": "compression", "quick": args.quick, "settings": base,
                      "results": results,
                      "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
