"""Allreduce bandwidth on gloo/CPU: pipelined ring vs native gloo, tree and master-worker.

For each world size n (one process per rank, loopback TCP) and message size S
(float32) it times every algorithm, round-robin and barrier-separated, after a
warm-up; the time of one iteration is the slowest rank's, and the figure is the
median over iterations (the best is reported too: on a shared machine it is
the figure least disturbed by other load). It reports algorithm bandwidth S/t
and bus bandwidth 2(n-1)/n * S/t, the CPU seconds all ranks spent per
allreduce, then fits an
alpha-beta model per algorithm (alpha per message on the critical path, beta
per byte) and extrapolates to 64..1024 silos at 64 MiB.

"native" is ``dist.all_reduce`` in place; the others are
``aggregation.ring.allreduce(x, out=y)``; "ring_unpipelined" sends whole chunks
one ring step after another. CUDA paths are not measured here.

    python benchmarks/allreduce.py            # n = 2, 4, 8; S = 1, 16, 64 MiB
    python benchmarks/allreduce.py --quick    # n = 2, 3; S = 64 KiB, 1 MiB

Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from ring_launch import launch

from aggregation.ring import DEFAULT_SEGMENT_BYTES, DEFAULT_WINDOW, allreduce

MIB = 1 << 20
ALGORITHMS = ("ring", "ring_inplace", "native", "tree", "master", "ring_unpipelined")
PREDICT_N = (64, 128, 256, 512, 1024)
PREDICT_BYTES = 64 * MIB
TARGET_RATIO = 0.95
TARGET_MIN_BYTES = 4 * MIB


def _callables(x: torch.Tensor, y: torch.Tensor, segment_bytes: int,
               window: int) -> dict[str, Callable[[], object]]:
    return {
        "ring": partial(allreduce, x, out=y, segment_bytes=segment_bytes, window=window),
        # in place, like native gloo (y holds a fresh copy of x before every call)
        "ring_inplace": partial(allreduce, y, out=y, segment_bytes=segment_bytes,
                                window=window),
        "native": partial(dist.all_reduce, y),
        "tree": partial(allreduce, x, out=y, algorithm="tree", segment_bytes=segment_bytes,
                        window=window),
        "master": partial(allreduce, x, out=y, algorithm="master",
                          segment_bytes=segment_bytes, window=window),
        "ring_unpipelined": partial(allreduce, x, out=y, segment_bytes=None),
    }


def measure(rank: int, n: int, sizes: list[int], iters: int, warmup: int,
            segment_bytes: int, window: int) -> list[dict[str, object]]:
    """Runs on every rank; rank 0's return value is the one reported."""
    rows = []
    for size in sizes:
        x = torch.randn(size // 4)
        y = torch.zeros_like(x)
        fns = _callables(x, y, segment_bytes, window)
        wall: dict[str, list[float]] = {k: [] for k in fns}
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        for it in range(warmup + iters):
            for name, fn in fns.items():
                y.copy_(x)  # keep values bounded: native reduces y in place
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                spent = torch.tensor([time.perf_counter() - t0, time.process_time() - c0],
                                     dtype=torch.float64)
                slowest = spent.clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                dist.all_reduce(spent)
                if it >= warmup:
                    wall[name].append(float(slowest[0]))
                    cpu[name].append(float(spent[1]))
        for name in fns:
            t = statistics.median(wall[name])
            rows.append({
                "n": n, "size_bytes": size, "algorithm": name, "time_s": t,
                "best_s": min(wall[name]),
                "algbw_GBps": size / t / 1e9, "busbw_GBps": 2 * (n - 1) / n * size / t / 1e9,
                "cpu_s_all_ranks": statistics.median(cpu[name]),
                "samples_s": [round(v, 6) for v in wall[name]],
            })
    return rows


def cost_terms(algorithm: str, n: int) -> tuple[float, float]:
    """(messages, bytes per byte of S) on the critical path, textbook step counts."""
    if algorithm in ("ring", "ring_inplace", "native", "ring_unpipelined"):
        return 2 * (n - 1), 2 * (n - 1) / n
    if algorithm == "tree":
        p = 1 << (n.bit_length() - 1)
        steps = int(math.log2(p)) + (2 if p != n else 0)
        return steps, steps
    if algorithm == "master":
        return 2 * (n - 1), 2 * (n - 1)
    raise ValueError(algorithm)


def fit_alpha_beta(rows: list[dict[str, object]], algorithm: str) -> dict[str, float]:
    """Least squares (on relative error) of t = alpha * messages + beta * bytes, both >= 0."""
    pts = [r for r in rows if r["algorithm"] == algorithm]
    a = np.array([[cost_terms(algorithm, r["n"])[0], cost_terms(algorithm, r["n"])[1]
                   * r["size_bytes"]] for r in pts], dtype=float)
    t = np.array([r["time_s"] for r in pts], dtype=float)
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if coef.min() < 0:  # refit with the negative term dropped
        keep = int(np.argmax(coef))
        only, *_ = np.linalg.lstsq(a[:, [keep]] * w[:, None], t * w, rcond=None)
        coef = np.zeros(2)
        coef[keep] = max(float(only[0]), 0.0)
    rel = np.abs(a @ coef - t) / t
    return {"alpha_s": float(coef[0]), "beta_s_per_byte": float(coef[1]),
            "beta_GBps": (1 / coef[1] / 1e9) if coef[1] > 0 else None,
            "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max())}


def predict(model: dict[str, float], algorithm: str, n: int, size: int) -> float:
    msgs, per_byte = cost_terms(algorithm, n)
    return model["alpha_s"] * msgs + model["beta_s_per_byte"] * per_byte * size


def extrapolate(models: dict[str, dict[str, float]]) -> dict[str, object]:
    """Predicted times at PREDICT_BYTES for many silos, and where ring beats tree."""
    times = {alg: [predict(m, alg, n, PREDICT_BYTES) for n in PREDICT_N]
             for alg, m in models.items()}
    crossover = []
    ring, tree = models["ring"], models["tree"]
    for n in PREDICT_N:
        mr, kr = cost_terms("ring", n)
        mt, kt = cost_terms("tree", n)
        gap_beta = tree["beta_s_per_byte"] * kt - ring["beta_s_per_byte"] * kr
        gap_alpha = ring["alpha_s"] * mr - tree["alpha_s"] * mt
        # ring is faster for S > gap_alpha / gap_beta (when gap_beta > 0)
        crossover.append(max(gap_alpha / gap_beta, 0.0) if gap_beta > 0 else None)
    return {
        "size_bytes": PREDICT_BYTES, "n": list(PREDICT_N),
        "time_s": {alg: [round(v, 4) for v in ts] for alg, ts in times.items()},
        "ring_beats_tree": [r < t for r, t in zip(times["ring"], times["tree"], strict=True)],
        "ring_beats_tree_above_bytes": [None if c is None else round(c) for c in crossover],
    }


def _all_or_none(flags: list[bool]) -> bool | None:
    """``all(flags)``, or None when there is nothing to judge."""
    return all(flags) if flags else None


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 2, 3; small sizes; 2 iters")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    args = parser.parse_args(argv)
    if args.quick:
        worlds, sizes, iters = (2, 3), [64 << 10, MIB], args.iters or 2
    else:
        worlds, sizes, iters = (2, 4, 8), [MIB, 16 * MIB, 64 * MIB], args.iters or 9
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.monotonic()
    rows: list[dict[str, object]] = []
    for n in worlds:
        out = launch(measure, n, sizes, iters, 1, args.segment_bytes, args.window,
                     timeout=900)
        rows += out[0]
        for size in sizes:
            here = {r["algorithm"]: r for r in out[0] if r["size_bytes"] == size}
            print(f"n={n} S={size / MIB:g} MiB  " + "  ".join(
                f"{a} {here[a]['time_s'] * 1e3:.1f} ms {here[a]['busbw_GBps']:.2f} GB/s"
                for a in ALGORITHMS), file=sys.stderr, flush=True)

    by_key = {(r["n"], r["size_bytes"], r["algorithm"]): r for r in rows}
    ratios = []
    for n in worlds:
        for size in sizes:
            ring, native = by_key[(n, size, "ring")], by_key[(n, size, "native")]
            ratio = ring["busbw_GBps"] / native["busbw_GBps"]
            inplace = by_key[(n, size, "ring_inplace")]["busbw_GBps"] / native["busbw_GBps"]
            ratios.append({"n": n, "size_bytes": size, "ring_over_native_busbw": round(ratio, 3),
                           "ring_inplace_over_native_busbw": round(inplace, 3),
                           "ring_over_native_best": round(native["best_s"] / ring["best_s"], 3),
                           "ring_over_native_cpu": round(
                               ring["cpu_s_all_ranks"] / native["cpu_s_all_ranks"], 3)})
    targeted = [r for r in ratios if r["size_bytes"] >= TARGET_MIN_BYTES]
    models = {alg: fit_alpha_beta(rows, alg) for alg in ALGORITHMS}
    summary = {
        "benchmark": "allreduce",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_cores": cores, "load_average_at_start": load,
                    "torch": torch.__version__, "backend": "gloo", "device": "cpu",
                    "transport": "TCP loopback, one process per rank"},
        "oversubscribed_world_sizes": [n for n in worlds if n > cores],
        "quick": args.quick, "iterations": iters, "warmup": 1, "dtype": "float32",
        "segment_bytes": args.segment_bytes, "window": args.window,
        "results": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                    for r in rows],
        "ring_vs_native": ratios,
        "target": {"ring_over_native_busbw": TARGET_RATIO, "min_size_bytes": TARGET_MIN_BYTES,
                   "met": _all_or_none([r["ring_over_native_busbw"] >= TARGET_RATIO
                                        for r in targeted]),
                   "met_in_place": _all_or_none([r["ring_inplace_over_native_busbw"]
                                                 >= TARGET_RATIO for r in targeted]),
                   "met_where_not_oversubscribed": _all_or_none(
                       [r["ring_over_native_busbw"] >= TARGET_RATIO for r in targeted
                        if r["n"] <= cores])},
        "alpha_beta": models,
        "prediction": extrapolate(models),
        "cuda": "not measured" if not torch.cuda.is_available() else "not measured by this script",
        "seconds": round(time.monotonic() - started, 1),
    }
    return summary


if __name__ == "__main__":
    print(json.dumps(main(), allow_nan=False))
