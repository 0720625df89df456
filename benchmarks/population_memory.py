"""Peak memory of FedProx Synthetic for large populations, held in memory or made on demand.

Each count runs in a fresh interpreter, which reports its resident set before the work and
its peak (``VmHWM``: unlike ``ru_maxrss`` it is not inherited from the parent that spawned
it) after it.

- ``measure`` (used by ``simulation_overhead.py``): load ``synthetic`` with ``num_users`` =
  the client count (one user per client, the natural partition) and partition it, beside
  the bytes of the loaded arrays. The loader's target: the peak growth under twice the data.
- ``python benchmarks/population_memory.py [--quick]``: a built-in scenario's task
  (``synthetic``, natural partition, logreg) with ``data.population = "memory"`` and
  ``"on_demand"`` per population: build and check the task, then make a cohort of random
  clients (training data and held-out split) and the central test sample; peak resident
  growth and seconds of each step. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from harness import log, peak_rss_bytes
from machine_info import load_average, machine

POPULATIONS = [10_000, 100_000, 1_000_000, 15_000_000]
MEMORY_UP_TO = 10_000  # larger populations held in memory take minutes and gigabytes
QUICK_POPULATIONS = [1_000, 100_000]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(users: int) -> None:
    """In a fresh interpreter: load, partition, print the figures."""
    from simulations.datasets import load_dataset
    from simulations.partitioners import partition

    before = _rss_bytes()
    ds = load_dataset("synthetic", seed=0, test_fraction=0.2, alpha=1.0, beta=1.0,
                      num_users=users)
    parts = partition(ds.y_train, users, kind="natural", seed=0, groups=ds.groups)
    peak = peak_rss_bytes()
    data = sum(a.nbytes for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.groups))
    print(json.dumps({"users": users, "samples": len(ds.y_train) + len(ds.y_test),
                      "partitions": len(parts), "data_bytes": data, "rss_before": before,
                      "peak_rss": peak}), flush=True)


def measure(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for users in counts:
        out = subprocess.run([sys.executable, __file__, str(users)], capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise RuntimeError(f"synthetic load of {users} users failed:\n{out.stderr[-2000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["peak_growth_over_data"] = round((row["peak_rss"] - row["rss_before"])
                                             / row["data_bytes"], 3)
        rows.append(row)
        log(f"synthetic, {users:>6} users: {row['data_bytes'] / 2**20:8.1f} MiB of data, peak "
            f"RSS {row['peak_rss'] / 2**20:8.1f} MiB ({row['rss_before'] / 2**20:.1f} before "
            f"loading): growth {row['peak_growth_over_data']}x the data")
    return rows


def task_child(mode: str, population: int, cohort: int) -> None:
    """In a fresh interpreter: build, check and sample a task; print the figures."""
    import numpy as np

    from simulations.config import load_scenario
    from simulations.task import ScenarioTask

    config = load_scenario("default", [
        "data.dataset=synthetic", "data.partitioner=natural", "model.kind=logreg",
        f"federation.clients={population}", f"data.options.num_users={population}",
        f"data.population={mode}"])
    before = _rss_bytes()
    t0 = time.perf_counter()
    task = ScenarioTask.from_config(config)
    task.check()
    t1 = time.perf_counter()
    samples = 0
    for pid in np.random.default_rng(0).choice(population, cohort, replace=False):
        x, _ = task.partition(int(pid))
        held = task.client_test(int(pid))
        samples += len(x) + (0 if held is None else len(held[0]))
    t2 = time.perf_counter()
    test = len(task.load_test())
    t3 = time.perf_counter()
    print(json.dumps({"mode": mode, "population": population, "cohort": cohort,
                      "cohort_samples": samples, "test_samples": test,
                      "on_demand": task.on_demand, "rss_before": before,
                      "peak_growth": peak_rss_bytes() - before,
                      "build_check_s": round(t1 - t0, 3), "cohort_s": round(t2 - t1, 3),
                      "test_sample_s": round(t3 - t2, 3)}), flush=True)


def measure_tasks(populations: list[int], cohort: int, memory_up_to: int
                  ) -> list[dict[str, Any]]:
    rows = []
    for population in populations:
        for mode in ("memory", "on_demand"):
            if mode == "memory" and population > memory_up_to:
                continue
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(population),
                                  str(cohort)], capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{mode} population of {population} failed:\n"
                                   f"{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            log(f"{mode:>9}, {population:>10,} clients: peak growth "
                f"{row['peak_growth'] / 2**20:8.1f} MiB, build+check {row['build_check_s']:.2f}"
                f" s, {cohort} clients {row['cohort_s']:.2f} s, test sample "
                f"{row['test_sample_s']:.2f} s")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"populations {QUICK_POPULATIONS}, a cohort of 20")
    parser.add_argument("--populations", default=",".join(map(str, POPULATIONS)))
    parser.add_argument("--cohort", type=int, default=1000)
    parser.add_argument("--memory-up-to", type=int, default=MEMORY_UP_TO,
                        help="hold populations up to this size in memory too")
    args = parser.parse_args(argv)
    populations = (QUICK_POPULATIONS if args.quick
                   else [int(p) for p in args.populations.split(",")])
    cohort = 20 if args.quick else args.cohort
    rows = measure_tasks(populations, cohort, args.memory_up_to)
    print(json.dumps({"benchmark": "population_memory", "quick": args.quick,
                      "cohort": cohort, "rows": rows, "machine": machine(),
                      "load_average": load_average()}))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].isdigit():
        child(int(sys.argv[1]))
    elif len(sys.argv) == 5 and sys.argv[1] == "--child":
        task_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
