"""Throughput of the aggregation pipeline beside a plain numpy copy of the same bytes.

For N updates of d float32 values it times one aggregation as a sync round runs it
(``open_round``, then Validate, Weight by examples and WeightedMean through
``RoundAggregation.submit`` with a look at each verdict, then ``finish``) and, in the
same run, ``np.copyto`` of every update into one preallocated buffer of length d. Both
read N * d * 4 bytes once and start from inputs that exist already (the arrays; the
decoded updates holding them). The two are timed in turn, copy then aggregation or the
other way round, and ``ratio`` is the median over those pairs of copy time / aggregation
time (a burst of load on a shared machine spoils a pair, not the figure); the pipeline
reaches the target when it runs at least half the copy's rate.

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
import statistics
import time
from pathlib import Path

import numpy as np
from machine_info import load_average, machine
from scipy.linalg.blas import saxpy, scopy, sdot

from aggregation import Pipeline, Update, Validate, Weight, WeightedMean
from aggregation.combine import blas_on_calling_thread

TARGET_RATIO = 0.5
FULL_SIZES = [(10, 10_000), (100, 10_000), (10, 1_000_000), (100, 1_000_000)]
QUICK_SIZES = [(4, 1_000), (4, 100_000)]
SLICE = 65_536  # floats per fused slice: 256 KiB, beside its accumulator slice in L2


def last_level_cache_bytes() -> int:
    """The size of the largest CPU cache (Linux sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KM":
            sizes.append(int(text[:-1]) << (10 if text[-1] == "K" else 20))
    return max(sizes, default=32 << 20)


class CacheState:
    """What the caches hold when a timed pass starts.

    Updates that fill at most half the last-level cache stay there between passes (warm,
    as a round's freshly decoded deltas are). Larger ones would be read partly from
    cache, by an amount that depends on the pass run before (with 40 MB of updates on a
    32 MB cache, either side ran up to 25% faster when it followed itself); for them
    every pass starts after writing a buffer of twice the cache, so that both sides read
    the updates from memory.
    """

    def __init__(self, nbytes: int) -> None:
        llc = last_level_cache_bytes()
        self.scratch = np.zeros(2 * llc // 4, np.float32) if nbytes > llc // 2 else None

    @property
    def name(self) -> str:
        return "warm" if self.scratch is None else "evicted"

    def reset(self) -> None:
        if self.scratch is not None:
            self.scratch += 1.0


def time_pipeline(pipe: Pipeline, updates: list[Update], d: int) -> float:
    """Seconds for one aggregation of ``updates``, as a sync round runs it: open, submit
    each update and look at its verdict, finish."""
    t0 = time.perf_counter()
    agg = pipe.open_round(dim=d, version=0)
    for update in updates:
        verdict = agg.submit(update)
        if not verdict.accepted:
            raise AssertionError(verdict.reason)
    result = agg.finish()
    t1 = time.perf_counter()
    assert result is not None
    return t1 - t0


def time_copy(buf: np.ndarray, rows: list[np.ndarray]) -> float:
    """Seconds to copy every array of ``rows`` into ``buf``."""
    t0 = time.perf_counter()
    for row in rows:
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


def time_kernels(updates: np.ndarray, buf: np.ndarray, reps: int,
                 cache: CacheState) -> dict[str, float]:
    """Each kernel's rate as a fraction of the copy's, each timed right after a copy
    (medians over ``reps``)."""
    d = updates.shape[1]
    rows = list(updates)
    acc, spare = np.zeros(d, np.float32), np.zeros(d, np.float32)
    ratios: dict[str, list[float]] = {k: [] for k in KERNELS}
    for _ in range(reps):
        for name, kernel in KERNELS.items():
            cache.reset()
            t_copy = time_copy(buf, rows)
            cache.reset()
            t0 = time.perf_counter()
            kernel(updates, acc, spare, 0.5)
            ratios[name].append(t_copy / (time.perf_counter() - t0))
    return {k: round(statistics.median(v), 3) for k, v in ratios.items()}


def bench(n: int, d: int, reps: int, rng: np.random.Generator) -> dict:
    updates = rng.standard_normal((n, d), dtype=np.float32)
    counts = [int(c) for c in rng.integers(1, 1000, n)]
    # Both sides start from inputs that exist already: the copy from the arrays, the
    # pipeline from the decoded updates that hold the same arrays (decoding is not timed).
    rows = list(updates)
    batch = [Update(f"c{i}", row, counts[i], 0) for i, row in enumerate(rows)]
    pipe = Pipeline(Validate(), Weight("examples"), WeightedMean())
    blas_on_calling_thread()  # as the pipeline does, here already for the kernels
    buf = np.empty(d, dtype=np.float32)
    nbytes = n * d * 4
    cache = CacheState(nbytes)
    time_pipeline(pipe, batch, d)  # warm up (page faults, BLAS init)
    time_copy(buf, rows)
    pipe_s, copy_s = [], []
    for rep in range(reps):  # interleaved in turn, so both see the same machine load
        for side in ("pipeline", "copy") if rep % 2 else ("copy", "pipeline"):
            cache.reset()
            if side == "pipeline":
                pipe_s.append(time_pipeline(pipe, batch, d))
            else:
                copy_s.append(time_copy(buf, rows))
    t_pipe, t_copy = statistics.median(pipe_s), statistics.median(copy_s)
    pipe_gbps, copy_gbps = nbytes / t_pipe / 1e9, nbytes / t_copy / 1e9
    # Each copy beside the aggregation timed next to it: a burst of load on the shared
    # machine then spoils one pair, which the median leaves out.
    paired = [c / p for c, p in zip(copy_s, pipe_s, strict=True)]
    ratio = round(statistics.median(paired), 3)
    return {
        "n": n, "d": d, "bytes": nbytes, "reps": reps, "cache": cache.name,
        "pipeline_s": float(f"{t_pipe:.4g}"), "copy_s": float(f"{t_copy:.4g}"),
        "pipeline_gbps": round(pipe_gbps, 3), "copy_gbps": round(copy_gbps, 3),
        "ratio": ratio,
        "ratio_range": [round(min(paired), 3), round(max(paired), 3)],
        "ratio_of_medians": round(pipe_gbps / copy_gbps, 3),
        "per_update_us": round(t_pipe / n * 1e6, 2),
        "meets_target": ratio >= TARGET_RATIO,
        "kernel_ratios": time_kernels(updates, buf, reps, cache),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    load_before = load_average()
    rng = np.random.default_rng(args.seed)
    results = []
    for n, d in sizes:
        reps = args.reps or (2 if args.quick else (11 if n * d >= 10**8 else 21))
        r = bench(n, d, reps, rng)
        results.append(r)
        print(f"N={n:>4} d={d:>9,}: pipeline {r['pipeline_gbps']:7.2f} GB/s, "
              f"copy {r['copy_gbps']:7.2f} GB/s, ratio {r['ratio']:.2f} "
              f"[{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}] "
              f"({r['per_update_us']:.1f} us/update, median of {reps}, {r['cache']})"
              f"{'' if r['meets_target'] else '  BELOW TARGET'}")
        print("    kernels / copy: " + ", ".join(f"{k} {v:.2f}"
                                               for k, v in r["kernel_ratios"].items()))
    summary = {
        "benchmark": "aggregation_throughput",
        "loadavg_before": load_before,
        "loadavg": load_average(),
        "quick": args.quick,
        "target_ratio": TARGET_RATIO,
        "meets_target": all(r["meets_target"] for r in results),
        "machine": machine(),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
