"""Throughput of the aggregation pipeline beside a plain numpy copy of the same bytes.

For N updates of d float32 values it times one aggregation (Validate, Weight by
examples, WeightedMean through ``RoundAggregation.submit``, then ``finish``) and,
in the same run, ``np.copyto`` of every update into one preallocated buffer of
length d. Both read N * d * 4 bytes once; the pipeline reaches the target when
it runs at least half the copy's rate.

Beside it, the same run times bare kernels for one design question: validation needs
each delta's norm before the delta is accepted, so the pipeline reads a delta twice
(norm, then axpy; the second read comes from cache when the delta fits in it). A fused
pass over cache-sized slices (norm of a slice, then axpy of that hot slice) reads it
once, but an update found bad at a later slice (non-finite, over max_norm) must leave
no trace, so the slices already added must be restorable:

- ``two_pass``: norm of the whole delta, then one axpy (what the pipeline runs);
- ``fused_unchecked``: per slice, norm then axpy, nothing kept to undo: NOT exact
  under a late rejection, the lower bound of any fused design;
- ``fused_undo``: per slice, norm, save the accumulator's slice, then axpy (exact);
- ``fused_pingpong``: per slice, norm, then write acc + w*d into a second accumulator
  (copy and axpy on the hot slice), swapping the two after each update (exact, nothing
  to restore).

    python benchmarks/aggregation_throughput.py [--quick] [--reps R]

Human-readable lines go first; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
from scipy.linalg.blas import saxpy, scopy, sdot

from aggregation import Pipeline, Update, Validate, Weight, WeightedMean
from aggregation.combine import blas_on_calling_thread

TARGET_RATIO = 0.5
FULL_SIZES = [(10, 10_000), (100, 10_000), (10, 1_000_000), (100, 1_000_000)]
QUICK_SIZES = [(4, 1_000), (4, 100_000)]
SLICE = 65_536  # floats per fused slice: 256 KiB, beside its accumulator slice in L2


def time_pipeline(pipe: Pipeline, updates: np.ndarray, counts: list[int]) -> float:
    """Seconds for one aggregation of all rows of ``updates``."""
    n, d = updates.shape
    t0 = time.perf_counter()
    agg = pipe.open_round(dim=d, version=0)
    for i in range(n):
        verdict = agg.submit(Update(f"c{i}", updates[i], counts[i], 0))
        assert verdict.accepted, verdict.reason
    result = agg.finish()
    t1 = time.perf_counter()
    assert result is not None
    return t1 - t0


def time_copy(buf: np.ndarray, updates: np.ndarray) -> float:
    """Seconds to copy every row of ``updates`` into ``buf``."""
    t0 = time.perf_counter()
    for row in updates:
        np.copyto(buf, row)
    return time.perf_counter() - t0


def _two_pass(updates: np.ndarray, acc: np.ndarray, spare: np.ndarray, w: float) -> None:
    for row in updates:
        if not sdot(row, row) < np.inf:
            raise ValueError("non-finite delta")
        saxpy(row, acc, row.size, w)


def _fused(updates: np.ndarray, acc: np.ndarray, spare: np.ndarray, w: float,
           keep: str) -> None:
    d = acc.size
    for row in updates:
        ss = 0.0
        for s in range(0, d, SLICE):
            n = min(SLICE, d - s)
            ss += sdot(row, row, n, s, 1, s, 1)
            if not ss < np.inf:  # the pipeline would now restore the slices before s
                raise ValueError("non-finite delta")
            if keep == "pingpong":  # spare = acc + w * row, slice by slice
                scopy(acc, spare, n, s, 1, s, 1)
                saxpy(row, spare, n, w, s, 1, s, 1)
                continue
            if keep == "undo":
                scopy(acc, spare, n, s, 1, s, 1)
            saxpy(row, acc, n, w, s, 1, s, 1)
        if keep == "pingpong":
            acc, spare = spare, acc


KERNELS = {
    "two_pass": _two_pass,
    "fused_unchecked": lambda u, a, b, w: _fused(u, a, b, w, "none"),
    "fused_undo": lambda u, a, b, w: _fused(u, a, b, w, "undo"),
    "fused_pingpong": lambda u, a, b, w: _fused(u, a, b, w, "pingpong"),
}


def time_kernels(updates: np.ndarray, buf: np.ndarray, reps: int) -> dict[str, float]:
    """Each kernel's rate as a fraction of the copy's, each timed right after a copy
    (medians over ``reps``)."""
    d = updates.shape[1]
    acc, spare = np.zeros(d, np.float32), np.zeros(d, np.float32)
    ratios: dict[str, list[float]] = {k: [] for k in KERNELS}
    for _ in range(reps):
        for name, kernel in KERNELS.items():
            t_copy = time_copy(buf, updates)
            t0 = time.perf_counter()
            kernel(updates, acc, spare, 0.5)
            ratios[name].append(t_copy / (time.perf_counter() - t0))
    return {k: round(statistics.median(v), 3) for k, v in ratios.items()}


def bench(n: int, d: int, reps: int, rng: np.random.Generator) -> dict:
    updates = rng.standard_normal((n, d), dtype=np.float32)
    counts = [int(c) for c in rng.integers(1, 1000, n)]
    pipe = Pipeline(Validate(), Weight("examples"), WeightedMean())
    blas_on_calling_thread()  # as the pipeline does, here already for the kernels
    buf = np.empty(d, dtype=np.float32)
    time_pipeline(pipe, updates, counts)  # warm up (page faults, BLAS init)
    time_copy(buf, updates)
    pipe_s, copy_s = [], []
    for _ in range(reps):  # interleaved, so both see the same machine load
        copy_s.append(time_copy(buf, updates))
        pipe_s.append(time_pipeline(pipe, updates, counts))
    nbytes = n * d * 4
    t_pipe, t_copy = statistics.median(pipe_s), statistics.median(copy_s)
    pipe_gbps, copy_gbps = nbytes / t_pipe / 1e9, nbytes / t_copy / 1e9
    return {
        "n": n, "d": d, "bytes": nbytes, "reps": reps,
        "pipeline_s": float(f"{t_pipe:.4g}"), "copy_s": float(f"{t_copy:.4g}"),
        "pipeline_gbps": round(pipe_gbps, 3), "copy_gbps": round(copy_gbps, 3),
        "ratio": round(pipe_gbps / copy_gbps, 3),
        "per_update_us": round(t_pipe / n * 1e6, 2),
        "meets_target": pipe_gbps >= TARGET_RATIO * copy_gbps,
        "kernel_ratios": time_kernels(updates, buf, reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    rng = np.random.default_rng(args.seed)
    results = []
    for n, d in sizes:
        reps = args.reps or (2 if args.quick else (5 if n * d >= 10**8 else 9))
        r = bench(n, d, reps, rng)
        results.append(r)
        print(f"N={n:>4} d={d:>9,}: pipeline {r['pipeline_gbps']:7.2f} GB/s, "
              f"copy {r['copy_gbps']:7.2f} GB/s, ratio {r['ratio']:.2f} "
              f"({r['per_update_us']:.1f} us/update, median of {reps})"
              f"{'' if r['meets_target'] else '  BELOW TARGET'}")
        print("    kernels / copy: " + ", ".join(f"{k} {v:.2f}"
                                               for k, v in r["kernel_ratios"].items()))
    summary = {
        "benchmark": "aggregation_throughput",
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "quick": args.quick,
        "target_ratio": TARGET_RATIO,
        "meets_target": all(r["meets_target"] for r in results),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
