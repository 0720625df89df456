"""Per-round cost of secure cross-silo rounds (SecAgg+ masks through the ring) over plain ones.

Workload: digits over 3 silos on fedring's in-process engine (real ServerApp, silo
ClientApp, SQLite store; each silo on its own thread, each ring in real processes over
gloo on loopback), one local epoch, ``rounds`` rounds per run. Two models: the default
MLP (4,810 parameters) and a wide one (hidden 1024 x 960: 1.06 M parameters). For each
model the plain run (``[driver] kind = "cross_silo"``) and the secure run (the same
with ``[secagg] enabled``) alternate ``reps`` times, so load drift hits both alike.

Reported per model: the median round wall time of each (the first round of a run is
left out: it starts the ring's process server), the secure run's extra seconds per
round and their ratio, and the secure run's median seconds per SecAgg+ stage (the
masked_input stage is the one that runs over the ring).

    python benchmarks/cross_silo_secure.py [--quick] [--reps N] [--rounds R] [--poll S]

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import WHOLE_PARTITIONS, log, timed_simulation
from machine_info import load_average, machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SILOS = 3
WORKLOAD = {**WHOLE_PARTITIONS,
            "federation.clients": SILOS, "federation.min_clients": SILOS,
            "train.local_epochs": 1, "federation.checkpoint_every": 0,
            "driver.kind": "cross_silo"}
MODELS = {"mlp_4.8k": {"model.hidden": [64]}, "mlp_1.06m": {"model.hidden": [1024, 960]}}


def run_rounds(values: dict[str, Any], db: str) -> tuple[list[float], list[dict[str, float]],
                                                          int]:
    """One run: its round wall seconds (after the first), the secure stages' seconds per
    round (empty for plain runs) and the model's parameter count."""
    from server.store import Store
    from simulations.config import load_scenario
    from simulations.task import ScenarioTask

    config = load_scenario("default", values=values)
    summary, _ = timed_simulation(config, db)
    assert summary["status"] == "completed", summary
    with Store(db) as store:
        walls = [r.wall_s for r in store.rounds(summary["run_id"]) if r.round >= 2]
        stages = [r["seconds"] for r in store.secagg_rounds(summary["run_id"]) if r["round"] >= 2]
    params = ScenarioTask.from_config(config).initial_params()[0].size
    return walls, stages, int(params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default model, 1 rep, "
                                                             "3 rounds")
    parser.add_argument("--reps", type=int, default=None, help="alternations (default 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 6)")
    parser.add_argument("--poll", type=float, default=None,
                        help="federation.poll_s: the server's wait between pulls (default "
                             "the scenario's)")
    args = parser.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    rounds = args.rounds or (3 if args.quick else 6)
    models = {"mlp_4.8k": MODELS["mlp_4.8k"]} if args.quick else MODELS
    load_before = load_average()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'bench.db'}"
        for name, model in models.items():
            walls: dict[str, list[float]] = {"plain": [], "secure": []}
            stages: list[dict[str, float]] = []
            params = 0
            for rep in range(reps):
                for mode in ("plain", "secure"):
                    values = {**WORKLOAD, **model, "federation.rounds": rounds,
                              "secagg.enabled": mode == "secure"}
                    if args.poll is not None:
                        values["federation.poll_s"] = args.poll
                    w, s, params = run_rounds(values, db)
                    walls[mode] += w
                    stages += s
                    log(f"{name} rep {rep} {mode}: median round "
                        f"{statistics.median(w) * 1e3:.1f} ms")
            plain, secure = (statistics.median(walls[m]) for m in ("plain", "secure"))
            per_stage = {k: round(statistics.median(s[k] for s in stages), 6)
                         for k in stages[0]} if stages else {}
            results.append({"model": name, "params": params, "silos": SILOS,
                            "rounds_timed": len(walls["plain"]),
                            "plain_round_s": round(plain, 6), "secure_round_s": round(secure, 6),
                            "secure_extra_s": round(secure - plain, 6),
                            "secure_over_plain": round(secure / plain, 3),
                            "secure_stage_s": per_stage})
            log(f"{name} ({params} parameters): plain {plain * 1e3:.1f} ms, secure "
                f"{secure * 1e3:.1f} ms per round ({secure / plain:.2f}x)")
    print(json.dumps({"benchmark": "cross_silo_secure", "quick": args.quick,
                      "machine": machine(), "loadavg_before": load_before,
                      "loadavg_after": load_average(), "reps": reps, "rounds": rounds,
                      "poll_s": args.poll,
                      "results": results}))


if __name__ == "__main__":
    main()
