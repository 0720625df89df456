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

``--secure``: secure aggregation's cost in a deployment. One ``fedring`` deployment with
TLS and SuperNode authentication (``fedring deploy up --auth``: ``fedring certs``
material, each SuperNode's SecAgg+ identity key and the federation's trusted keys in its
node config), the same model, and ``flwr run`` per variant, each with its own store, in
this order: ``plain`` (FedAvg), ``semi_honest`` (``secagg.enabled=true``) and
``malicious`` (``secagg.security=malicious``: signed advertisements, the derived graph,
the consistency check), then reversed, ``--repeats`` times in all (default 2: each
variant runs once early and once late in the deployment's life; a variant's median is
over the warm rounds of all its runs). Every secure round must be recorded as completed, in its mode
(the store's ``secagg_rounds``, whose per-stage server seconds are reported), and each
run's CPU seconds of the SuperLink process are read from ``/proc``. The figure
of merit is each secure variant's median warm round over the plain one's (target: at most
2). A secure round is two exchanges between the server and the SuperNodes once keys are
advertised ahead, in both modes (the malicious one pre-signs the survivor set; round 1
runs the usual flow, consistency check included; a plain round is one), each waiting for
the SuperNodes' next pull:
``--pull-interval`` sets their idle pull interval (default 0.2 s, as ``fedring deploy
up``); within 3 s of a reply they pull every 0.05 s (``client.supernode``).
The SuperLink is ``fedring deploy up``'s (``python -m server.superlink``: Flower's
middleware as one layer, trivial dependencies on the event loop); ``--flower-superlink``
runs Flower's ``flower-superlink`` instead, the code before that wrapper.

    python benchmarks/deploy_latency.py [--quick] [--rounds R] [--modes fedring,flower]
    python benchmarks/deploy_latency.py --secure [--quick] [--rounds R] [--pull-interval S]
                                        [--flower-superlink] [--repeats N]

``--quick`` runs only ``fedring`` with 3 rounds (with ``--secure``: each variant once).
Human-readable lines go to stderr; the last line of stdout is one JSON object.
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
SECURE_VARIANTS = {"plain": "", "semi_honest": "secagg.enabled=true",
                   "malicious": "secagg.enabled=true secagg.security=malicious"}
TARGET_SECURE_OVER_PLAIN = 2.0


def flwr_env(work: Path) -> dict[str, str]:
    os.environ["FLWR_HOME"] = str(work / "flwr")
    return {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def flwr_run(state: dict[str, Any], name: str, overrides: str, rounds: int, work: Path,
             env: dict[str, str]) -> dict[str, Any]:
    """One ``flwr run`` on a running deployment, into its own store; its rounds' wall times
    and, for a secure run, the modes its secure rounds were recorded in."""
    from server.store import Store

    db = f"sqlite:///{work / f'{name}.db'}"
    run_config = f'db="{db}" overrides="{overrides} federation.rounds={rounds}"'
    t1 = time.perf_counter()
    out = subprocess.run([str(Path(sys.executable).parent / "flwr"), "run", ".",
                          state["federation"], "--run-config", run_config, "--stream"],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300 + 150 * rounds)
    run_s = time.perf_counter() - t1
    if out.returncode != 0:
        raise RuntimeError(f"flwr run failed ({name}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    with Store(db) as store:
        [run] = store.list_runs()
        recorded = [r for r in store.rounds(run.run_id) if r.round > 0]
        secure = store.secagg_rounds(run.run_id)
    if run.status != "completed" or len(recorded) != rounds:
        raise RuntimeError(f"{name}: run {run.status} with {len(recorded)} of {rounds} rounds")
    if any(r.num_accepted != NODES for r in recorded):
        raise RuntimeError(f"{name}: a round did not get all {NODES} updates")
    walls = [round(r.wall_s, 3) for r in recorded]
    warm = walls[1:]
    return {"mode": name, "rounds": rounds, "round_s": walls, "first_round_s": walls[0],
            "warm_round_median_s": round(statistics.median(warm), 3) if warm else None,
            "warm_round_max_s": max(warm) if warm else None, "run_s": round(run_s, 2),
            "final_accuracy": recorded[-1].metrics.get("accuracy"),
            "secure_rounds": [{"round": r["round"], "status": r["status"],
                               "security": r["security"], "k": r["k"], "t": r["t"],
                               "server_stage_s": r["seconds"]} for r in secure]}


def run_variant(mode: str, rounds: int, work: Path) -> dict[str, Any]:
    """One deployment, one ``flwr run``; the per-round wall times from the store."""
    from simulations import deploy

    work.mkdir(parents=True)
    env = flwr_env(work)
    t0 = time.perf_counter()
    state = deploy.up(deploy.Options(nodes=NODES, mode=mode, db=f"sqlite:///{work / f'{mode}.db'}",
                                     state_dir=work / "state",
                                     timeout_s=300))
    up_s = time.perf_counter() - t0
    try:
        row = flwr_run(state, mode, OVERRIDES, rounds, work, env)
    finally:
        deploy.down(work / "state")
    row.pop("secure_rounds")
    return {**row, "up_s": round(up_s, 2)}


def check_secure(name: str, row: dict[str, Any]) -> None:
    """A secure variant's rounds were all secure, completed, and in the variant's mode."""
    expected = [{"round": r, "status": "completed", "security": name}
                for r in range(1, row["rounds"] + 1)]
    got = [{k: s[k] for k in ("round", "status", "security")} for s in row["secure_rounds"]]
    if got != expected:
        raise RuntimeError(f"{name}: secure rounds recorded as {got}, expected {expected}")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) that process ``pid`` has used, from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sitting_order(repeats: int) -> list[str]:
    """The variants' runs: plain, semi-honest, malicious, then the reverse, and so on, so
    that each variant runs as often early in the deployment's life as late."""
    names = list(SECURE_VARIANTS)
    return [n for rep in range(repeats) for n in (names if rep % 2 == 0 else names[::-1])]


def pooled(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's runs as one row: the median and max over every run's warm rounds, the
    SuperLink's CPU summed, each run kept under ``runs``."""
    if len(runs) == 1:
        return runs[0]
    warm = [w for r in runs for w in r["round_s"][1:]]
    return {"mode": name, "rounds": runs[0]["rounds"], "runs": runs,
            "round_s": [w for r in runs for w in r["round_s"]],
            "first_round_s": [r["first_round_s"] for r in runs],
            "warm_round_median_s": round(statistics.median(warm), 3) if warm else None,
            "warm_round_max_s": max(warm) if warm else None,
            "final_accuracy": runs[-1]["final_accuracy"],
            "secure_rounds": [s for r in runs for s in r["secure_rounds"]],
            "superlink_cpu_s": round(sum(r["superlink_cpu_s"] for r in runs), 3),
            "up_s": runs[0]["up_s"]}


def run_secure(rounds: int, work: Path, pull_interval: float,
               flower_superlink: bool = False, repeats: int = 1) -> list[dict[str, Any]]:
    """One TLS + SuperNode-auth deployment (identity keys in node config); plain,
    semi-honest and malicious runs on it in :func:`sitting_order`, each with the
    SuperLink process's CPU seconds; one row per variant (:func:`pooled`)."""
    from simulations import deploy

    work.mkdir(parents=True)
    env = flwr_env(work)
    t0 = time.perf_counter()
    state = deploy.up(deploy.Options(nodes=NODES, mode="fedring", tls=True, auth=True,
                                     pull_interval=pull_interval, state_dir=work / "state",
                                     timeout_s=300, flower_superlink=flower_superlink))
    up_s = round(time.perf_counter() - t0, 2)
    link = state["processes"][0]["pid"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SECURE_VARIANTS}
    try:
        for i, name in enumerate(sitting_order(repeats)):
            extra = SECURE_VARIANTS[name]
            log(f"{name}: {NODES} SuperNodes (TLS, node auth), {rounds} rounds ...")
            cpu = process_cpu_s(link)
            row = flwr_run(state, f"{name}-{i}", f"{OVERRIDES} {extra}".strip(), rounds, work,
                           env)
            row["mode"] = name
            row["superlink_cpu_s"] = round(process_cpu_s(link) - cpu, 3)
            if name == "plain":
                if row["secure_rounds"]:
                    raise RuntimeError(f"plain: secure rounds recorded: {row['secure_rounds']}")
            else:
                check_secure(name, row)
            log(f"{name}: rounds {row['round_s']} s; warm median {row['warm_round_median_s']} s;"
                f" SuperLink CPU {row['superlink_cpu_s']} s")
            runs[name].append({**row, "up_s": up_s})
    finally:
        deploy.down(work / "state")
    return [pooled(name, rows) for name, rows in runs.items()]


def secure_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each secure variant's median warm round over the plain one's, against the target."""
    by = {r["mode"]: r["warm_round_median_s"] for r in rows}
    plain = by.get("plain")
    ratios = {name: round(by[name] / plain, 3) for name in SECURE_VARIANTS
              if name != "plain" and by.get(name) and plain}
    return {"over_plain": ratios,
            "target": {"max_secure_over_plain": TARGET_SECURE_OVER_PLAIN,
                       "met": (max(ratios.values()) <= TARGET_SECURE_OVER_PLAIN
                               if len(ratios) == len(SECURE_VARIANTS) - 1 else None)}}


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
    parser.add_argument("--secure", action="store_true",
                        help="plain vs semi-honest vs malicious secure rounds, TLS and node auth")
    parser.add_argument("--pull-interval", type=float, default=0.2,
                        help="--secure: the SuperNodes' idle pull interval (s; as "
                             "`fedring deploy up --pull-interval`, default 0.2)")
    parser.add_argument("--flower-superlink", action="store_true",
                        help="--secure: Flower's flower-superlink instead of fedring's "
                             "wrapper (python -m server.superlink)")
    parser.add_argument("--repeats", type=int,
                        help="--secure: runs of each variant, in the order plain, "
                             "semi-honest, malicious, then reversed, and so on; the median "
                             "is over every run's warm rounds (default 2, quick 1)")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(ALL_MODES)} "
                                        "(default all; quick: fedring)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    modes = (args.modes.split(",") if args.modes
             else ["fedring"] if args.quick else list(ALL_MODES))
    if unknown := set(modes) - set(ALL_MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}")
    if args.secure and args.modes:
        parser.error("--secure runs fedring's deployment only: leave out --modes")
    started, load_before = time.perf_counter(), load_average()
    results = []
    pool = ThreadPoolExecutor(1)  # the imports overlap the deployments' waiting
    info = pool.submit(lambda: (machine(), parameters()))
    with tempfile.TemporaryDirectory(prefix="fedring-deploy-bench-") as tmp:
        if args.secure:
            results = run_secure(rounds, Path(tmp) / "secure", args.pull_interval,
                                 args.flower_superlink,
                                 args.repeats or (1 if args.quick else 2))
            modes = []
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
        "secure": args.secure,
        "speedup_warm_round": round(stock / fed, 1) if fed and stock else None,
        "target": {"max_warm_round_s": TARGET_ROUND_S,
                   "met": None if fed is None else fed <= TARGET_ROUND_S},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.secure:  # its target replaces the plain deployment's
        summary.update(secure_summary(results), pull_interval_s=args.pull_interval,
                       superlink="flower-superlink" if args.flower_superlink
                       else "server.superlink")
    if args.secure:
        log(f"secure over plain {summary['over_plain']}; target <= "
            f"{TARGET_SECURE_OVER_PLAIN}x: {summary['target']['met']}")
    else:
        log(f"target <= {TARGET_ROUND_S} s per warm round: {summary['target']['met']}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
