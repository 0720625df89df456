"""Populations of up to fifteen million clients at a fixed cohort: peak memory and round time.

Each population runs FedProx Synthetic (one user per client, ``data.population =
"on_demand"``), logistic regression, a fixed cohort per round, on the in-process engine
with the real ServerApp, ClientApp and a SQLite store, in a fresh interpreter that
reports its peak resident set (``VmHWM``), the seconds from the start of the run to the
end of its first round, and each later round's seconds. All populations run in one
invocation, one after the other, so their round times compare side by side (ratios: the
machine is shared).

``--contention``: a round of the cohort (population 10,000) on a quiet machine and beside
one CPU-bound process (a Python busy loop), for ``engine.threads = "auto"`` and ``0`` (the
process's setting), alternated, with the slowdown busy / quiet of each.

Prints one JSON object as the last stdout line; ``--plot`` writes
docs/population_scale.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, log, peak_rss_bytes

POPULATIONS = [10_000, 100_000, 1_000_000, 15_000_000]
QUICK_POPULATIONS = [2_000, 200_000]


def scenario(population: int, cohort: int, rounds: int, threads: str) -> dict[str, Any]:
    """The measured scenario: ``population`` Synthetic users made on demand, ``cohort`` per
    round, logistic regression."""
    from simulations.config import load_scenario

    return load_scenario("default", [
        f"federation.clients={population}", f"federation.rounds={rounds}",
        f"federation.sample_fraction={cohort / population!r}", "federation.min_clients=1",
        "data.dataset=synthetic", "data.partitioner=natural", "data.population=on_demand",
        f"data.options.num_users={population}", "data.client_test_fraction=0",
        "model.kind=logreg", "train.local_epochs=1",
        f"engine.threads={json.dumps(threads) if threads == 'auto' else int(threads)}"])


def child(population: int, cohort: int, rounds: int, threads: str) -> None:
    """In a fresh interpreter: run the scenario, print its figures as JSON."""
    from server.reporter import Reporter
    from simulations.cli import run_simulation

    marks: list[float] = []

    class Timer(Reporter):
        def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
            marks.append(time.perf_counter())

    config = scenario(population, cohort, rounds, threads)
    with tempfile.TemporaryDirectory(prefix="fedring-scale-") as folder:
        started = time.perf_counter()
        summary = run_simulation(config, engine="inprocess",
                                 db=f"sqlite:///{folder}/runs.db", reporter=Timer())
        wall = time.perf_counter() - started
    if summary.get("status") != "completed" or len(marks) != rounds:
        raise RuntimeError(f"the run did not complete its {rounds} rounds: {summary}")
    later = [b - a for a, b in itertools.pairwise(marks)]
    print(json.dumps({"population": population, "cohort": cohort, "threads": threads,
                      "peak_rss_bytes": peak_rss_bytes(),
                      "first_round_s": round(marks[0] - started, 3),
                      "round_s": [round(s, 3) for s in later],
                      "mean_round_s": round(sum(later) / len(later), 3) if later else None,
                      "wall_s": round(wall, 3)}), flush=True)


def measure(population: int, cohort: int, rounds: int, threads: str) -> dict[str, Any]:
    """One population in a fresh child interpreter."""
    out = subprocess.run([sys.executable, __file__, "--child", str(population),
                          "--cohort", str(cohort), "--rounds", str(rounds),
                          "--engine-threads", threads], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"population {population} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def populations(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for population in args.populations:
        row = measure(population, args.cohort, args.rounds, args.engine_threads)
        rows.append(row)
        log(f"{population:>11,} clients: peak RSS {row['peak_rss_bytes'] / 2**30:6.2f} GiB, "
            f"first round after {row['first_round_s']:7.1f} s, a round "
            f"{row['mean_round_s']} s")
    base = rows[0]["mean_round_s"]
    for row in rows:
        row["round_vs_smallest"] = (round(row["mean_round_s"] / base, 3)
                                    if base and row["mean_round_s"] else None)
    largest = rows[-1]
    return {"rows": rows, "largest": largest["population"],
            "largest_peak_rss_gb": round(largest["peak_rss_bytes"] / 1e9, 3),
            "largest_round_vs_smallest": largest["round_vs_smallest"],
            "target_peak_rss_gb": 2.0, "target_round_ratio": 1.2}


def contention(args: argparse.Namespace) -> dict[str, Any]:
    """Quiet and busy rounds for each thread setting, alternated."""
    busy_loop = [sys.executable, "-c", "while True: pass"]
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for threads in args.contention_threads.split(","):
            for load in ("quiet", "busy"):
                hog = subprocess.Popen(busy_loop) if load == "busy" else None
                try:
                    row = measure(args.contention_population, args.cohort, args.rounds,
                                  threads)
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                figures.setdefault(threads, {}).setdefault(load, []).extend(row["round_s"])
                log(f"threads {threads:>4}, {load}: rounds {row['round_s']} s")
    out: dict[str, Any] = {}
    for threads, loads in figures.items():
        quiet = sum(loads["quiet"]) / len(loads["quiet"])
        busy = sum(loads["busy"]) / len(loads["busy"])
        out[threads] = {"quiet_round_s": round(quiet, 3), "busy_round_s": round(busy, 3),
                        "slowdown": round(busy / quiet, 3)}
    return {"contention": out, "target_slowdown": 2.5}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["population"] for r in rows]
    fig, (rss, rnd) = plt.subplots(1, 2, figsize=(10, 4))
    rss.plot(x, [r["peak_rss_bytes"] / 1e9 for r in rows], "o-")
    rss.axhline(2.0, color="grey", linestyle="--", label="target 2 GB")
    rss.set(xscale="log", xlabel="population (clients)", ylabel="peak RSS (GB)",
            title="Peak memory")
    rss.legend()
    rnd.plot(x, [r["round_vs_smallest"] for r in rows], "o-", label="a round")
    rnd.plot(x, [r["first_round_s"] / rows[0]["first_round_s"] for r in rows], "s--",
             label="start to first round's end")
    rnd.axhline(1.2, color="grey", linestyle="--", label="target 1.2x")
    rnd.set(xscale="log", yscale="log", xlabel="population (clients)",
            ylabel=f"time / time at {x[0]:,} clients",
            title=f"Cohort of {rows[0]['cohort']:,} per round")
    rnd.legend()
    fig.suptitle("FedProx Synthetic, logistic regression, clients made on demand "
                 "(ratios, shared 2-core VM)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _counts(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="two small populations, a cohort of 20, two rounds")
    parser.add_argument("--populations", type=_counts, default=None,
                        help="comma-separated client counts (default 1e4,1e5,1e6,1.5e7)")
    parser.add_argument("--cohort", type=int, default=None, help="clients per round (1000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (3)")
    parser.add_argument("--engine-threads", default="auto",
                        help='engine.threads of the runs ("auto" or a number)')
    parser.add_argument("--contention", action="store_true",
                        help="also: rounds quiet and beside a busy loop, per thread setting")
    parser.add_argument("--contention-population", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="contention alternations")
    parser.add_argument("--contention-threads", default="auto,0",
                        help="engine.threads values of the contention runs (comma-separated)")
    parser.add_argument("--contention-only", action="store_true",
                        help="only the contention runs (no populations, no plot)")
    parser.add_argument("--plot", default=None,
                        help="PNG path (default docs/population_scale.png; none in quick mode)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cohort = args.cohort or (20 if args.quick else 1000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    if args.child is not None:
        child(args.child, args.cohort, args.rounds, args.engine_threads)
        return
    args.populations = args.populations or (QUICK_POPULATIONS if args.quick else POPULATIONS)
    args.contention_population = args.contention_population or (
        args.populations[0] if args.quick else 10_000)
    started = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "population_scale", "quick": args.quick,
                              "cohort": args.cohort, "rounds": args.rounds,
                              "engine_threads": args.engine_threads, "cpus": os.cpu_count()}
    if args.contention_only:
        result.update(contention(args))
        print(json.dumps(result))
        return
    result.update(populations(args))
    if args.contention:
        result.update(contention(args))
    result["bench_wall_s"] = round(time.perf_counter() - started, 1)
    path = Path(args.plot) if args.plot else (None if args.quick
                                              else ROOT / "docs" / "population_scale.png")
    if path is not None:
        plot(result, path)
        result["plot"] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
