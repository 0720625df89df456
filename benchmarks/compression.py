"""Bytes uploaded per round and final accuracy on digits, per kind of upload compression.

Runs the real ServerApp and ClientApp on the in-process engine for each variant of
``[compression]`` (none, QSGD at 8/4/2 bits, top-k with and without error feedback,
rand-k on a shared pattern); under secure aggregation (the ``secure`` column) without
compression, with QSGD and with rand-k; and with FedBuff's async buffers, dense and with
top-k. Reads each round's ``bytes_up``/``bytes_down`` and the final accuracy from the
store. Bytes count the payloads of the messages: array data (.npy headers included) and
the secure protocol's byte messages. Each row's ``upload_ratio`` compares it with the
dense row of its group (plain sync, secure, FedBuff). Prints human lines to stderr and
one JSON object as the last stdout line.

    python benchmarks/compression.py            # the default scenario: 20 clients, 10 rounds
    python benchmarks/compression.py --quick    # 4 clients, 1 round, six variants
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import WHOLE_PARTITIONS_OVERRIDE
from machine_info import load_average, machine

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
    "secagg+randk-10%": ["secagg.enabled=true", "compression.kind=topk",
                         "compression.fraction=0.1", "compression.shared_pattern=true"],
    "fedbuff": ["driver.kind=fedbuff"],
    "fedbuff+topk-10%": ["driver.kind=fedbuff", "compression.kind=topk",
                         "compression.fraction=0.1"],
}
QUICK_VARIANTS = ("none", "qsgd-4", "topk-10%", "secagg", "secagg+qsgd-8", "secagg+randk-10%")
# the default scenario otherwise
FULL = ["federation.checkpoint_every=0", WHOLE_PARTITIONS_OVERRIDE]
QUICK = [*FULL, "federation.clients=4", "federation.rounds=1", "train.local_epochs=1"]


def run_variant(name: str, base: list[str], db: str) -> dict[str, Any]:
    config = load_scenario("default", [*base, *VARIANTS[name]])
    t0 = time.perf_counter()
    summary = run_simulation(config, engine="inprocess", db=db)
    wall = time.perf_counter() - t0
    with Store(db) as store:
        rounds = [r for r in store.rounds(summary["run_id"])
                  if 1 <= r.round <= summary["rounds"]]  # not an async run's unapplied rest
    per_round = [r.metrics.get("bytes_up") for r in rounds]
    secure, driver = config["secagg"]["enabled"], config["driver"]["kind"]
    return {"variant": name, "group": "secure" if secure else driver, "secure": secure,
            "driver": driver, "compression": config["compression"],
            "secagg_bits": config["secagg"]["bits"] if secure else None,
            "rounds": len(rounds), "clients": config["federation"]["clients"],
            "bytes_up_total": summary["bytes_up"], "bytes_down_total": summary["bytes_down"],
            "bytes_up_per_round": summary["bytes_up"] / max(1, len(rounds)),
            "bytes_down_per_round": summary["bytes_down"] / max(1, len(rounds)),
            "bytes_up_per_round_stored": per_round if None not in per_round else None,
            "final_accuracy": summary["final_accuracy"], "wall_s": round(wall, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    base, names = (QUICK, QUICK_VARIANTS) if args.quick else (FULL, tuple(VARIANTS))
    load_before = load_average()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'compression.db'}"
        for name in names:
            results.append(run_variant(name, base, db))
            print(json.dumps(results[-1]), file=sys.stderr)
    dense = {"sync": "none", "secure": "secagg", "fedbuff": "fedbuff"}  # each group's dense
    per_round = {r["variant"]: r["bytes_up_per_round"] for r in results}
    for r in results:
        reference = per_round[dense[r["group"]]]
        r["upload_ratio"] = round(reference / r["bytes_up_per_round"], 3)
    print(json.dumps({"benchmark": "compression", "quick": args.quick, "settings": base,
                      "results": results, "machine": machine(),
                      "loadavg_before": load_before, "loadavg_after": load_average()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
