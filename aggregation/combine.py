"""Combine stages: how accepted, weighted deltas become one aggregate delta."""

from __future__ import annotations

import functools

import numpy as np
from scipy.linalg.blas import saxpy


@functools.cache
def blas_on_calling_thread() -> None:
    """Once per process: OpenBLAS (numpy's and scipy's) runs on the calling thread.

    OpenBLAS wakes its thread pool for vectors over 10,000 elements. On busy cores (a
    server beside simulated clients) waking it stalled each call for milliseconds (13-20
    ms per 1M-float update), and a memory-bound norm or axpy gains little from a second
    core. Slicing vectors into 10,000-element calls avoided the pool but cost ~100 Python
    calls per million elements; one call per vector on this thread costs one.
    """
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().select(internal_api="openblas").limit(limits=1)


class Combine:
    """Base class. ``linear`` combines can run under secure aggregation and over a ring."""

    linear: bool = False

    def start(self, dim: int) -> None:
        raise NotImplementedError

    def add(self, delta: np.ndarray, weight: float) -> None:
        raise NotImplementedError

    def result(self) -> np.ndarray | None:
        """The combined delta, or None when nothing was added."""
        raise NotImplementedError


class WeightedMean(Combine):
    """sum(w_i d_i) / sum(w_i), accumulated in place as updates arrive (one pass each)."""

    linear = True

    def __init__(self) -> None:
        self._acc: np.ndarray | None = None
        self.total_weight = 0.0

    def start(self, dim: int) -> None:
        blas_on_calling_thread()
        self._acc = np.zeros(dim, dtype=np.float32)
        self.total_weight = 0.0

    def add(self, delta: np.ndarray, weight: float) -> None:
        assert self._acc is not None, "start() first"
        # BLAS saxpy: acc += weight * delta in one streaming pass, no temporary; acc (float32,
        # contiguous) is updated in place. A strided delta is copied once by the wrapper.
        if delta.size:  # (the BLAS wrapper refuses empty vectors)
            saxpy(delta, self._acc, delta.size, weight)
        self.total_weight += weight

    def result(self) -> np.ndarray | None:
        if self._acc is None or self.total_weight <= 0:
            return None
        self._acc *= np.float32(1.0 / self.total_weight)
        return self._acc


class WeightedSum(WeightedMean):
    """sum(w_i d_i), for callers that normalise themselves (e.g. FedAsync mixing)."""

    def result(self) -> np.ndarray | None:
        if self._acc is None or self.total_weight <= 0:
            return None
        return self._acc


def make_combine(kind: str, **params: float) -> Combine:
    """Build a combine stage by name."""
    kinds: dict[str, type[Combine]] = {"mean": WeightedMean, "sum": WeightedSum}
    if kind not in kinds:
        raise ValueError(f"unknown combine '{kind}'; choose one of: {', '.join(kinds)}")
    if params:
        raise ValueError(f"combine '{kind}' takes no parameters, got {sorted(params)}")
    return kinds[kind]()
