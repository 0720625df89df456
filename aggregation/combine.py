"""Combine stages: how accepted, weighted deltas become one aggregate delta."""

from __future__ import annotations

import functools

import numpy as np
from scipy.linalg.blas import saxpy, sscal


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
    #: Whether the result is sum(w d) / sum(w): a caller that knows a different total
    #: weight may rescale it (FedBuff's buffers, whose weights follow staleness).
    normalized: bool = False
    #: Whether the combine works around the previous aggregate (``begin``'s ``center``).
    needs_center: bool = False

    def begin(self, *, version: int, center: np.ndarray | None) -> None:
        """Told, after ``start``, the model version this aggregation is against and the
        previous aggregate the pipeline kept (None: none yet, or not kept)."""
        return None

    def __copy__(self) -> Combine:
        """A shallow copy (one per aggregation), without copy.copy's generic protocol."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def start(self, dim: int) -> None:
        raise NotImplementedError

    def add(self, delta: np.ndarray, weight: float) -> None:
        raise NotImplementedError

    def result(self) -> np.ndarray | None:
        """The combined delta, or None when nothing was added."""
        raise NotImplementedError


class WeightedMean(Combine):
    """sum(w_i d_i) / sum(w_i), accumulated in place as updates arrive (one pass each).

    After the first ``add``, a caller may add more deltas itself, as ``add`` would, with
    BLAS ``saxpy(delta, running_sum, delta.size, weight)``, and then set ``total_weight``
    to the sum of all the weights before ``result()`` (the lean path of
    ``RoundAggregation`` does, to save a Python call per update).
    """

    linear = True
    normalized = True

    def __init__(self) -> None:
        self.running_sum: np.ndarray | None = None
        self.total_weight = 0.0
        self._count = 0

    def start(self, dim: int) -> None:
        blas_on_calling_thread()
        # Not zeroed: the first add writes it whole (zeroing 4 MB costs half an update).
        self.running_sum = np.empty(dim, dtype=np.float32)
        self.total_weight = 0.0
        self._count = 0

    def add(self, delta: np.ndarray, weight: float) -> None:
        acc = self.running_sum
        if acc is None:
            raise RuntimeError("start() first")
        if self._count and delta.size:  # (the BLAS wrapper refuses empty vectors)
            # BLAS saxpy: acc += weight * delta in one streaming pass, no temporary; acc
            # (float32, contiguous) is updated in place. A strided delta is copied once.
            saxpy(delta, acc, delta.size, weight)
        else:  # the first: acc = weight * delta, one write pass, the same float32 products
            np.multiply(delta, np.float32(weight), out=acc, dtype=np.float32)
        self._count += 1
        self.total_weight += weight

    def result(self) -> np.ndarray | None:
        acc = self.running_sum
        if acc is None or self.total_weight <= 0:
            return None
        if acc.size:  # (the BLAS wrapper refuses empty vectors)
            sscal(1.0 / self.total_weight, acc)  # in place, as acc *= float32(1 / W)
        return acc


class WeightedSum(WeightedMean):
    """sum(w_i d_i), for callers that normalise themselves (e.g. FedAsync mixing)."""

    normalized = False

    def result(self) -> np.ndarray | None:
        if self.running_sum is None or self.total_weight <= 0:
            return None
        return self.running_sum


def make_combine(kind: str, **params: float) -> Combine:
    """Build a combine stage by name."""
    kinds: dict[str, type[Combine]] = {"mean": WeightedMean, "sum": WeightedSum}
    if kind not in kinds:
        raise ValueError(f"unknown combine '{kind}'; choose one of: {', '.join(kinds)}")
    if params:
        raise ValueError(f"combine '{kind}' takes no parameters, got {sorted(params)}")
    return kinds[kind]()
