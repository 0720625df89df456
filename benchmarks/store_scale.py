"""``fedring report`` and ``fedring runs`` on a store holding a run of 1,000 rounds of 1,000
clients: how long each command takes.

The store is filled through its own API (``Store.record_round`` with one update record per
client of each round's cohort, as a run records them), in a SQLite file of a temporary
folder; each command then runs as a user would run it, in a fresh interpreter, and its
wall seconds are reported beside the seconds of a bare ``fedring --help`` (the interpreter
and imports). Prints one JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, log


def fill(url: str, rounds: int, clients: int) -> str:
    """A run of ``rounds`` rounds, each with ``clients`` accepted updates and a few metrics."""
    from server.store import Store, UpdateRecord

    with Store(url) as store:
        run_id = store.create_run(config={"federation": {"clients": clients * 1000,
                                                         "rounds": rounds}}, seed=0,
                                  name="store-scale")
        for rnd in range(1, rounds + 1):
            updates = [UpdateRecord(client_id=str(rnd * 7919 + i), fate="accepted",
                                    num_examples=20 + i % 7, base_version=rnd - 1,
                                    staleness=0, norm=0.5 + i * 1e-4, weight=1.0,
                                    metrics={"train_loss": 1.0 / rnd})
                       for i in range(clients)]
            store.record_round(run_id, round=rnd, model_version=rnd, num_sampled=clients,
                               num_replies=clients, num_accepted=clients,
                               metrics={"accuracy": 0.5, "loss": 1.0 / rnd}, wall_s=1.0,
                               updates=updates)
        store.finish_run(run_id, status="completed", summary={"status": "completed"})
    return run_id


def timed(argv: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stderr[-2000:]}")
    return round(time.perf_counter() - started, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds of 50 clients")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--clients", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (20 if args.quick else 1000)
    clients = args.clients or (50 if args.quick else 1000)
    fedring = [sys.executable, "-m", "simulations.cli"]
    with tempfile.TemporaryDirectory(prefix="fedring-store-") as folder:
        url = f"sqlite:///{folder}/runs.db"
        started = time.perf_counter()
        run_id = fill(url, rounds, clients)
        fill_s = round(time.perf_counter() - started, 1)
        log(f"{rounds} rounds x {clients} updates recorded in {fill_s} s")
        result: dict[str, Any] = {
            "benchmark": "store_scale", "quick": args.quick, "rounds": rounds,
            "clients": clients, "update_rows": rounds * clients, "fill_s": fill_s,
            "db_bytes": Path(folder, "runs.db").stat().st_size,
            "help_s": timed([*fedring, "--help"], ROOT),
            "runs_s": timed([*fedring, "runs", "--db", url], ROOT),
            "runs_json_s": timed([*fedring, "runs", "--db", url, "--json"], ROOT),
            "report_s": timed([*fedring, "report", run_id, "--db", url, "--out", folder],
                              ROOT),
            "report_json_s": timed([*fedring, "report", run_id, "--db", url, "--json"], ROOT),
            "report_round_updates_s": timed([*fedring, "report", run_id, "--db", url,
                                             "--updates", "--round", str(rounds // 2)], ROOT),
        }
    for key, value in result.items():
        if key.endswith("_s") and key != "fill_s":
            log(f"{key:>24}: {value} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
