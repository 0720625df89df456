"""Allreduce bandwidth on gloo/CPU: pipelined ring vs native gloo and the other algorithms.

Measured: ring (pipelined, out of place and in place, and unpipelined), native gloo,
tree (recursive doubling), halving_doubling (Rabenseifner), all_to_all, round_robin and
master-worker; round_robin is also compared with the ring iteration by iteration.

For each world size n (one process per rank, loopback TCP) and message size S
(float32) it times every algorithm, barrier-separated, after a warm-up; each
iteration runs every size and algorithm once, so a shared machine's load falls on
all cells alike. The time of one iteration is the slowest rank's, and the figure is
the median over iterations (the best is reported too: on a shared machine it is
the figure least disturbed by other load); halving_doubling and the ring are also
compared with native gloo iteration by iteration (median, quartiles and range of
the paired ratios), and the load average is recorded around each world size. It
reports algorithm bandwidth S/t and bus bandwidth 2(n-1)/n * S/t, the CPU seconds
all ranks spent per allreduce, then fits an alpha-beta model per algorithm (alpha
per message on the critical path, beta per byte, each times its own slow-down for the
busy ranks sharing this machine's cores) to each cell's best time, reports how far
each fitted model is from each measured cell (best and median), and extrapolates to 64..1024
silos at 64 KiB..64 MiB: which algorithm wins each cell and by how much (``--plot
PATH`` draws the predictions).

"native" is ``dist.all_reduce`` in place; the others are
``aggregation.ring.allreduce(x, out=y)``; "ring_unpipelined" sends whole chunks
one ring step after another. CUDA paths are not measured here.

    python benchmarks/allreduce.py            # n = 2, 4, 8; S = 1, 16, 64 MiB
    python benchmarks/allreduce.py --quick    # n = 2, 3; S = 64 KiB, 1 MiB
    python benchmarks/allreduce.py --plot docs/allreduce_model.png
    python benchmarks/allreduce.py --pair halving_doubling_inplace   # the target's cells

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
ALGORITHMS = ("ring", "ring_inplace", "native", "tree", "halving_doubling",
              "halving_doubling_inplace", "all_to_all", "round_robin", "master",
              "ring_unpipelined")
# The algorithms compared in the predictions (the ring variants share the ring's terms).
CONTENDERS = ("ring", "native", "tree", "halving_doubling", "all_to_all", "round_robin",
              "master")
PREDICT_N = (64, 128, 256, 512, 1024)
PREDICT_BYTES = 64 * MIB
PREDICT_SIZES = (64 << 10, MIB, 16 * MIB, 64 * MIB)
TARGET_RATIO = 0.95
TARGET_MIN_BYTES = 4 * MIB
HD_TARGET_N = (2, 4)
HD_TARGET_BYTES = (16 * MIB, 64 * MIB)
MODEL_TARGET_REL_ERROR = 0.25
MODEL_TIME = "best_s"  # the time the alpha-beta model is fitted to and judged against


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
        "halving_doubling": partial(allreduce, x, out=y, algorithm="halving_doubling",
                                    segment_bytes=segment_bytes, window=window),
        "halving_doubling_inplace": partial(allreduce, y, out=y, algorithm="halving_doubling",
                                            segment_bytes=segment_bytes, window=window),
        "all_to_all": partial(allreduce, x, out=y, algorithm="all_to_all",
                              segment_bytes=segment_bytes, window=window),
        "round_robin": partial(allreduce, x, out=y, algorithm="round_robin",
                               segment_bytes=segment_bytes, window=window),
        "master": partial(allreduce, x, out=y, algorithm="master",
                          segment_bytes=segment_bytes, window=window),
        "ring_unpipelined": partial(allreduce, x, out=y, segment_bytes=None),
    }


def measure(rank: int, n: int, sizes: list[int], iters: int, warmup: int,
            segment_bytes: int, window: int,
            algorithms: tuple[str, ...] = ALGORITHMS) -> list[dict[str, object]]:
    """Runs on every rank; rank 0's return value is the one reported. Each iteration
    runs every size and every one of ``algorithms`` once, so the load of a shared
    machine falls on all cells alike."""
    bufs = {}
    for size in sizes:
        x = torch.randn(size // 4)
        y = torch.zeros_like(x)
        fns = _callables(x, y, segment_bytes, window)
        bufs[size] = (x, y, {name: fns[name] for name in algorithms})
    wall = {(size, name): [] for size in sizes for name in algorithms}
    cpu = {(size, name): [] for size in sizes for name in algorithms}
    for it in range(warmup + iters):
        for size in sizes:
            x, y, fns = bufs[size]
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
                    wall[(size, name)].append(float(slowest[0]))
                    cpu[(size, name)].append(float(spent[1]))
    rows = []
    for size in sizes:
        for name in algorithms:
            samples = wall[(size, name)]
            t = statistics.median(samples)
            rows.append({
                "n": n, "size_bytes": size, "algorithm": name, "time_s": t,
                "best_s": min(samples),
                "algbw_GBps": size / t / 1e9, "busbw_GBps": 2 * (n - 1) / n * size / t / 1e9,
                "cpu_s_all_ranks": statistics.median(cpu[(size, name)]),
                "samples_s": [round(v, 6) for v in samples],
            })
    return rows


def cost_terms(algorithm: str, n: int) -> tuple[float, float]:
    """(messages, bytes per byte of S) on the critical path, textbook step counts."""
    if algorithm in ("ring", "ring_inplace", "native", "ring_unpipelined"):
        return 2 * (n - 1), 2 * (n - 1) / n
    p = 1 << (n.bit_length() - 1)
    fold = 2 if p != n else 0  # non-powers of two: the extra ranks' vector in and out
    if algorithm == "tree":
        steps = int(math.log2(p)) + fold
        return steps, steps
    if algorithm in ("halving_doubling", "halving_doubling_inplace"):
        return 2 * int(math.log2(p)) + fold, 2 * (p - 1) / p + fold
    if algorithm == "all_to_all":
        return 2 * (n - 1), 2 * (n - 1) / n
    if algorithm == "round_robin":  # a round-robin tournament: a rank rests once if n is odd
        return 2 * (n - 1 + n % 2), 2 * (n - 1) / n
    if algorithm == "master":
        return 2 * (n - 1), 2 * (n - 1)
    raise ValueError(algorithm)


def busy_ranks(algorithm: str, n: int) -> int:
    """Ranks working at the same time: all of them, except in master-worker, where rank 0
    exchanges with one worker at a time while the others wait."""
    return min(n, 2) if algorithm == "master" else n


def sharing(n: int, cores: int | None, gamma: float) -> float:
    """How much slower each rank runs when ``n`` busy ranks share ``cores`` cores:
    ``(n / cores) ** gamma``, at least 1; 1 without ``cores`` (a silo per machine)."""
    return 1.0 if cores is None else max(1.0, n / cores) ** gamma


def design(algorithm: str, n: int, size: int, cores: int | None,
           gammas: tuple[float, float]) -> tuple[float, float]:
    """The model's two terms before alpha and beta: messages and bytes on the critical
    path, each times its own slow-down for ranks sharing cores. A message waits for its
    receiver to be scheduled, which grows faster with the ranks per core than the share of
    CPU time that bounds the bytes, so latency and bandwidth each get an exponent."""
    msgs, per_byte = cost_terms(algorithm, n)
    busy = busy_ranks(algorithm, n)
    return (msgs * sharing(busy, cores, gammas[0]),
            per_byte * size * sharing(busy, cores, gammas[1]))


def fit_alpha_beta(rows: list[dict[str, object]], algorithm: str, cores: int | None = None,
                   gammas: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """Least squares (on relative error) of t = alpha * messages * s_a + beta * bytes * s_b
    (see ``design``; ``gammas = (0, 0)``: the plain alpha-beta model), alpha and beta >= 0.
    ``t`` is each cell's best time (``MODEL_TIME``): the model describes a machine of its
    own, not the other load of a shared one."""
    pts = [r for r in rows if r["algorithm"] == algorithm]
    a = np.array([design(algorithm, r["n"], r["size_bytes"], cores, gammas) for r in pts])
    t = np.array([r[MODEL_TIME] for r in pts], dtype=float)
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
            "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max()),
            "sum_sq_rel_error": float((rel ** 2).sum()),
            "sharing_gamma_alpha": gammas[0], "sharing_gamma_beta": gammas[1]}


def fit_sharing(rows: list[dict[str, object]], cores: int) -> tuple[float, float]:
    """The one pair of exponents (each 0 to 2, steps of 0.1) for this machine that, with
    alpha and beta fitted per algorithm, minimises the squared relative error over every
    measured cell."""
    algorithms = sorted({r["algorithm"] for r in rows})
    grid = [round(0.1 * k, 1) for k in range(21)]
    return min(((ga, gb) for ga in grid for gb in grid),
               key=lambda g: sum(fit_alpha_beta(rows, a, cores, g)["sum_sq_rel_error"]
                                 for a in algorithms))


def predict(model: dict[str, float], algorithm: str, n: int, size: int,
            cores: int | None = None) -> float:
    """Predicted time; ``cores``: ranks share that many cores (the measuring machine),
    ``None``: every rank has its own machine (silos)."""
    msgs, per_byte = design(algorithm, n, size, cores,
                            (model["sharing_gamma_alpha"], model["sharing_gamma_beta"]))
    return model["alpha_s"] * msgs + model["beta_s_per_byte"] * per_byte


def model_errors(rows: list[dict[str, object]], models: dict[str, dict[str, float]],
                 cores: int) -> list[dict[str, object]]:
    """Each measured cell against its algorithm's fitted model on this machine:
    (predicted - measured) / measured, against the best time (what the model is fitted
    to) and against the median (which carries the shared machine's other load)."""
    errors = []
    for r in rows:
        t = predict(models[r["algorithm"]], r["algorithm"], r["n"], r["size_bytes"], cores)
        errors.append({"n": r["n"], "size_bytes": r["size_bytes"], "algorithm": r["algorithm"],
                       "measured_s": round(r[MODEL_TIME], 9), "predicted_s": round(t, 9),
                       "rel_error": round(t / r[MODEL_TIME] - 1, 3),
                       "measured_median_s": round(r["time_s"], 9),
                       "rel_error_median": round(t / r["time_s"] - 1, 3)})
    return errors


def winners(models: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    """For each predicted (n, size): the fastest algorithm and its lead over the runner-up."""
    table = []
    for size in PREDICT_SIZES:
        for n in PREDICT_N:
            times = sorted((predict(models[a], a, n, size), a) for a in CONTENDERS)
            (best_t, best), (second_t, second) = times[0], times[1]
            table.append({"n": n, "size_bytes": size, "winner": best,
                          "time_s": round(best_t, 4), "runner_up": second,
                          "runner_up_s": round(second_t, 4),
                          "speedup_over_runner_up": round(second_t / best_t, 3) if best_t > 0
                          else None,
                          "time_s_by_algorithm": {a: round(t, 4) for t, a in times}})
    return table


def plot(models: dict[str, dict[str, float]], path: str) -> None:
    """Predicted time against the number of silos, one panel per message size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [2 ** k for k in range(1, 11)] + [48, 96, 192, 384, 768]
    ns.sort()
    fig, axes = plt.subplots(1, len(PREDICT_SIZES), figsize=(4 * len(PREDICT_SIZES), 4),
                             sharex=True)
    for ax, size in zip(axes, PREDICT_SIZES, strict=True):
        for alg in CONTENDERS:
            ax.plot(ns, [predict(models[alg], alg, n, size) for n in ns], marker=".",
                    label=alg)
        ax.axvspan(min(PREDICT_N), max(PREDICT_N), color="0.92")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{size / MIB:g} MiB" if size >= MIB else f"{size >> 10} KiB")
        ax.set_xlabel("silos n")
    axes[0].set_ylabel("predicted allreduce time (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle("alpha-beta models fitted on gloo/CPU at n = 2, 4, 8 (shaded: 64-1024)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        "winners": winners(models),
        "ring_beats_tree": [r < t for r, t in zip(times["ring"], times["tree"], strict=True)],
        "ring_beats_tree_above_bytes": [None if c is None else round(c) for c in crossover],
    }


def paired_ratios(native: dict[str, object], other: dict[str, object]) -> dict[str, float]:
    """Per-iteration native time / other time (the bus-bandwidth ratio; iterations run the
    algorithms back to back, so each pair saw about the same load): median, quartiles
    and range."""
    r = sorted(a / b for a, b in zip(native["samples_s"], other["samples_s"], strict=True))
    q = np.quantile(r, [0.25, 0.5, 0.75])
    return {"median": round(float(q[1]), 3), "q1": round(float(q[0]), 3),
            "q3": round(float(q[2]), 3), "min": round(r[0], 3), "max": round(r[-1], 3)}


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _all_or_none(flags: list[bool]) -> bool | None:
    """``all(flags)``, or None when there is nothing to judge."""
    return all(flags) if flags else None


def _machine(cores: int, load: float | None,
             loads: dict[int, dict[str, float | None]]) -> dict[str, object]:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_cores": cores, "load_average_at_start": load,
            "load_average_by_world_size": loads, "load_average_at_end": _load(),
            "torch": torch.__version__, "backend": "gloo", "device": "cpu",
            "transport": "TCP loopback, one process per rank"}


def run_worlds(worlds: tuple[int, ...], sizes: list[int], iters: int, args: argparse.Namespace,
               algorithms: tuple[str, ...]) -> tuple[list[dict[str, object]],
                                                     dict[int, dict[str, float | None]]]:
    """``measure`` at each world size in turn; a line per size on stderr. Returns the rows
    and the load average before and after each world size."""
    loads: dict[int, dict[str, float | None]] = {}
    rows: list[dict[str, object]] = []
    for n in worlds:
        loads[n] = {"start": _load()}
        out = launch(measure, n, sizes, iters, 1, args.segment_bytes, args.window, algorithms,
                     timeout=900)[0]
        loads[n]["end"] = _load()
        rows += out
        for size in sizes:
            here = {r["algorithm"]: r for r in out if r["size_bytes"] == size}
            print(f"n={n} S={size / MIB:g} MiB load {loads[n]['start']}-{loads[n]['end']}  "
                  + "  ".join(
                f"{a} {here[a]['time_s'] * 1e3:.1f} ms {here[a]['busbw_GBps']:.2f} GB/s"
                for a in algorithms), file=sys.stderr, flush=True)
    return rows, loads


def pair(args: argparse.Namespace) -> dict[str, object]:
    """Native gloo and ``args.pair`` only, alternated each iteration, at the
    halving_doubling target's cells (n = 2, 4; 16 and 64 MiB): the target measured
    with nothing else in the run. Quick: n = 2; 64 KiB and 1 MiB; 2 iterations."""
    if args.quick:
        worlds, sizes, iters = (2,), [64 << 10, MIB], args.iters or 2
    else:
        worlds, sizes, iters = HD_TARGET_N, list(HD_TARGET_BYTES), args.iters or 20
    algorithms = ("native", args.pair)
    load = _load()
    started = time.monotonic()
    rows, loads = run_worlds(worlds, sizes, iters, args, algorithms)
    by_key = {(r["n"], r["size_bytes"], r["algorithm"]): r for r in rows}
    cells = []
    for n in worlds:
        for size in sizes:
            native, other = (by_key[(n, size, a)] for a in algorithms)
            cells.append({
                "n": n, "size_bytes": size,
                "over_native_busbw": round(other["busbw_GBps"] / native["busbw_GBps"], 3),
                "paired": paired_ratios(native, other),
                "cpu_over_native": round(
                    other["cpu_s_all_ranks"] / native["cpu_s_all_ranks"], 3)})
            print(f"n={n} S={size / MIB:g} MiB  {args.pair} over native "
                  f"{cells[-1]['over_native_busbw']} (paired median "
                  f"{cells[-1]['paired']['median']}), CPU {cells[-1]['cpu_over_native']}x",
                  file=sys.stderr, flush=True)
    return {
        "benchmark": "allreduce_pair", "algorithm": args.pair, "quick": args.quick,
        "machine": _machine(os.cpu_count() or 1, load, loads), "iterations": iters,
        "warmup": 1,
        "dtype": "float32", "segment_bytes": args.segment_bytes, "window": args.window,
        "results": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                    for r in rows],
        "cells": cells,
        "target": {"over_native_busbw": TARGET_RATIO,
                   "met": None if args.quick else _all_or_none(
                       [c["over_native_busbw"] >= TARGET_RATIO for c in cells])},
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 2, 3; small sizes; 2 iters")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--plot", default=None, help="write the predictions' plot here")
    parser.add_argument("--pair", choices=[a for a in ALGORITHMS if a != "native"],
                        help="time only native gloo and this algorithm, alternated, at "
                             "n = 2, 4 and 16, 64 MiB (20 iterations)")
    args = parser.parse_args(argv)
    if args.pair:
        return pair(args)
    if args.quick:
        worlds, sizes, iters = (2, 3), [64 << 10, MIB], args.iters or 2
    else:
        worlds, sizes, iters = (2, 4, 8), [MIB, 16 * MIB, 64 * MIB], args.iters or 9
    cores = os.cpu_count() or 1
    load = _load()
    started = time.monotonic()
    rows, loads = run_worlds(worlds, sizes, iters, args, ALGORITHMS)
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
    hd = [{"n": n, "size_bytes": size, "halving_doubling_over_native_busbw": round(
               by_key[(n, size, "halving_doubling")]["busbw_GBps"]
               / by_key[(n, size, "native")]["busbw_GBps"], 3),
           "halving_doubling_inplace_over_native_busbw": round(
               by_key[(n, size, "halving_doubling_inplace")]["busbw_GBps"]
               / by_key[(n, size, "native")]["busbw_GBps"], 3),
           "halving_doubling_over_native_best": round(
               by_key[(n, size, "native")]["best_s"]
               / by_key[(n, size, "halving_doubling")]["best_s"], 3),
           "paired": {alg: paired_ratios(by_key[(n, size, "native")], by_key[(n, size, alg)])
                      for alg in ("halving_doubling", "halving_doubling_inplace", "ring",
                                  "ring_inplace")}}
          for n in worlds for size in sizes]
    hd_targeted = [r for r in hd if r["n"] in HD_TARGET_N and r["size_bytes"] in HD_TARGET_BYTES]
    round_robin = [{"n": n, "size_bytes": size, "round_robin_over_ring_busbw": round(
                        by_key[(n, size, "round_robin")]["busbw_GBps"]
                        / by_key[(n, size, "ring")]["busbw_GBps"], 3),
                    "paired": paired_ratios(by_key[(n, size, "ring")],
                                            by_key[(n, size, "round_robin")])}
                   for n in worlds for size in sizes]
    gammas = fit_sharing(rows, cores)
    models = {alg: fit_alpha_beta(rows, alg, cores, gammas) for alg in ALGORITHMS}
    plain = {alg: fit_alpha_beta(rows, alg) for alg in ALGORITHMS}
    errors = model_errors(rows, models, cores)
    # The same model fitted to the medians instead, for comparison.
    medians = [dict(r, best_s=r["time_s"]) for r in rows]
    gammas_median = fit_sharing(medians, cores)
    median_errors = model_errors(
        medians, {a: fit_alpha_beta(medians, a, cores, gammas_median) for a in ALGORITHMS}, cores)
    if args.plot:
        plot(models, args.plot)
    summary = {
        "benchmark": "allreduce",
        "machine": _machine(cores, load, loads),
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
        "halving_doubling_vs_native": hd,
        "halving_doubling_target": {
            "over_native_busbw": TARGET_RATIO, "n": list(HD_TARGET_N),
            "size_bytes": list(HD_TARGET_BYTES),
            "met": _all_or_none([r["halving_doubling_over_native_busbw"] >= TARGET_RATIO
                                 for r in hd_targeted]),
            "met_in_place": _all_or_none([r["halving_doubling_inplace_over_native_busbw"]
                                          >= TARGET_RATIO for r in hd_targeted])},
        "round_robin_vs_ring": round_robin,
        "alpha_beta": models,
        "alpha_beta_without_sharing": plain,
        "model_errors": errors,
        "model_target": {
            "max_rel_error": MODEL_TARGET_REL_ERROR, "fitted_to": MODEL_TIME,
            "met": _all_or_none([abs(e["rel_error"]) <= MODEL_TARGET_REL_ERROR
                                 for e in errors]),
            "cells_within": sum(abs(e["rel_error"]) <= MODEL_TARGET_REL_ERROR for e in errors),
            "cells_within_of_median": sum(abs(e["rel_error_median"]) <= MODEL_TARGET_REL_ERROR
                                          for e in errors),
            "cells": len(errors),
            "fitted_to_medians": {
                "sharing_gammas": list(gammas_median),
                "cells_within": sum(abs(e["rel_error"]) <= MODEL_TARGET_REL_ERROR
                                    for e in median_errors)},
            "met_by_algorithm": {alg: _all_or_none(
                [abs(e["rel_error"]) <= MODEL_TARGET_REL_ERROR for e in errors
                 if e["algorithm"] == alg]) for alg in ALGORITHMS}},
        "prediction": extrapolate(models),
        "plot": args.plot,
        "cuda": "not measured" if not torch.cuda.is_available() else "not measured by this script",
        "seconds": round(time.monotonic() - started, 1),
    }
    return summary


if __name__ == "__main__":
    print(json.dumps(main(), allow_nan=False))
