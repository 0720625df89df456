"""Seconds per round of Flower's deployment engine on loopback: Flower's defaults vs fedring's.

Workload: the default scenario with a 9,610-parameter MLP (``model.hidden=[128]``),
1 local epoch, 3 SuperNodes, every node every round, on 127.0.0.1 without TLS. Each
variant is a fresh ``simulations.deploy.up`` (a SuperLink and 3 SuperNodes), one
``flwr run . <federation> --stream`` and ``deploy.down``:

- ``flower``: Flower 1.41's defaults: ``flower-supernode --isolation subprocess`` (a new
  ``flwr-clientapp`` process per message, which imports flwr, torch and the app and
  rebuilds model and partition), the SuperNode's 3 s idle sleep and 0.5 s reply waits;
- ``fastpoll``: the same per-message processes, with the SuperNode's waits shortened
  (``client.supernode``: 0.2 s idle pull, 10 ms reply waits) and
  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1``;
- ``warm``: Flower's SuperNode and waits, with ``--isolation process`` and one warm
  ClientApp process per SuperNode (``client.executor``);
- ``fedring``: short waits plus one warm ClientApp process per SuperNode
  (``--isolation process`` with ``client.executor``), torch threads shared out among
  the SuperNodes.

A round's time is the run store's ``wall_s`` (from the server sampling the round to the
round being recorded: push, the SuperNodes' pulls, training, replies, aggregation,
central evaluation, checkpoint). Round 1 also loads the app and is reported apart; the
figure of merit is the median of rounds 2..R. fedring's ServerApp already pulls replies
every ``federation.poll_s`` (0.05 s) instead of Flower's ``HttpGrid`` 3 s.

    python benchmarks/deploy_latency.py [--quick] [--rounds R] [--modes fedring,flower]

``--quick`` runs only ``fedring`` with 3 rounds. Human-readable lines go to stderr; the
last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import log
from machine_info import load_average, machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODES = 3
HIDDEN = [128]  # 9,610 parameters on digits
OVERRIDES = (f"federation.clients={NODES} federation.min_clients={NODES} "
             f"model.hidden=[{HIDDEN[0]}] train.local_epochs=1")
TARGET_ROUND_S = 2.0
ALL_MODES = ("flower", "fastpoll", "warm", "fedring")


def run_variant(mode: str, rounds: int, work: Path) -> dict[str, Any]:
    """One deployment, one ``flwr run``; the per-round wall times from the store."""
    from server.store import Store
    from simulations import deploy

    work.mkdir(parents=True)
    os.environ["FLWR_HOME"] = str(work / "flwr")
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    db = f"sqlite:///{work / 'store.db'}"
    run_config = f'db="{db}" overrides="{OVERRIDES} federation.rounds={rounds}"'
    t0 = time.perf_counter()
    state = deploy.up(deploy.Options(nodes=NODES, mode=mode, db=db, state_dir=work / "state",
                                     timeout_s=300))
    up_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        out = subprocess.run([str(Path(sys.executable).parent / "flwr"), "run", ".",
                              state["federation"], "--run-config", run_config, "--stream"],
                             cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300 + 150 * rounds)
        run_s = time.perf_counter() - t1
    finally:
        deploy.down(work / "state")
    if out.returncode != 0:
        raise RuntimeError(f"flwr run failed ({mode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    with Store(db) as store:
        [run] = store.list_runs()
        recorded = [r for r in store.rounds(run.run_id) if r.round > 0]
    if run.status != "completed" or len(recorded) != rounds:
        raise RuntimeError(f"{mode}: run {run.status} with {len(recorded)} of {rounds} rounds")
    if any(r.num_accepted != NODES for r in recorded):
        raise RuntimeError(f"{mode}: a round did not get all {NODES} updates")
    walls = [round(r.wall_s, 3) for r in recorded]
    warm = walls[1:]
    return {"mode": mode, "rounds": rounds, "round_s": walls, "first_round_s": walls[0],
            "warm_round_median_s": round(statistics.median(warm), 3) if warm else None,
            "warm_round_max_s": max(warm) if warm else None, "up_s": round(up_s, 2),
            "run_s": round(run_s, 2), "final_accuracy": recorded[-1].metrics.get("accuracy")}


def parameters() -> int:
    """Parameters of the benchmark's model, as the scenario builds it."""
    from simulations.config import load_scenario
    from simulations.models import count_parameters
    from simulations.task import ScenarioTask

    config = load_scenario("default", values={"model.hidden": HIDDEN})
    return count_parameters(ScenarioTask.from_config(config).build_model())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fedring only, 3 rounds")
    parser.add_argument("--rounds", type=int, help="rounds per run (default 5, quick 3)")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(ALL_MODES)} "
                                        "(default all; quick: fedring)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    modes = (args.modes.split(",") if args.modes
             else ["fedring"] if args.quick else list(ALL_MODES))
    if unknown := set(modes) - set(ALL_MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}")
    started, load_before = time.perf_counter(), load_average()
    results = []
    pool = ThreadPoolExecutor(1)  # the imports overlap the deployments' waiting
    info = pool.submit(lambda: (machine(), parameters()))
    with tempfile.TemporaryDirectory(prefix="fedring-deploy-bench-") as tmp:
        for mode in modes:
            log(f"{mode}: {NODES} SuperNodes, {rounds} rounds ...")
            row = run_variant(mode, rounds, Path(tmp) / mode)
            log(f"{mode}: rounds {row['round_s']} s; warm median "
                f"{row['warm_round_median_s']} s; up {row['up_s']} s, run {row['run_s']} s")
            results.append(row)
    by_mode = {r["mode"]: r for r in results}
    fed = by_mode.get("fedring", {}).get("warm_round_median_s")
    stock = by_mode.get("flower", {}).get("warm_round_median_s")
    summary = {
        "benchmark": "deploy_latency", "quick": args.quick, "nodes": NODES,
        "params": info.result()[1], "machine": info.result()[0],
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "results": results,
        "speedup_warm_round": round(stock / fed, 1) if fed and stock else None,
        "target": {"max_warm_round_s": TARGET_ROUND_S,
                   "met": None if fed is None else fed <= TARGET_ROUND_S},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    log(f"target <= {TARGET_ROUND_S} s per warm round: {summary['target']['met']}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
