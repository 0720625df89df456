"""Bucketing (Karimireddy, He, Jaggi, ICLR 2022, "Byzantine-robust learning on
heterogeneous datasets via bucketing"): before a robust combine, the updates are put in a
random order, split into buckets of ``s`` consecutive ones (the last may be smaller) and
each bucket is replaced by its weighted mean, with the bucket's total weight. The robust
combine then sees ``ceil(n / s)`` means that are more alike than the updates themselves,
which is what keeps it from discarding honest but unusual updates on non-IID data.

The order is drawn from the run seed and the model version the aggregation is against
(the round, in rounds that each apply an aggregate), so a resumed run draws the same.
"""

from __future__ import annotations

import math

import numpy as np

from aggregation.robust import RobustCombine, _count

__all__ = ["Bucketing", "bucket_means"]

_STREAM = 0xB0C4E7  # keeps the bucket draw apart from the run's other seeded draws


def bucket_means(x: np.ndarray, w: np.ndarray, order: np.ndarray,
                 size: int) -> tuple[np.ndarray, np.ndarray]:
    """The weighted mean and total weight of each bucket of ``size`` rows of ``x`` taken in
    ``order`` (a permutation of the rows)."""
    n = x.shape[0]
    buckets = math.ceil(n / size)
    means = np.empty((buckets, x.shape[1]), dtype=np.float32)
    weights = np.empty(buckets, dtype=np.float64)
    for b in range(buckets):
        rows = order[b * size:(b + 1) * size]
        wb = w[rows]
        weights[b] = wb.sum()
        means[b] = (wb / weights[b]) @ x[rows].astype(np.float64)
    return means, weights


class Bucketing(RobustCombine):
    """``inner`` applied to the means of random buckets of ``size`` updates."""

    def __init__(self, inner: RobustCombine, size: int, seed: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.size = _count("aggregation.bucketing", size, minimum=2)
        self.seed = _count("seed", seed)
        self.version = 0
        self.needs_center = inner.needs_center

    def describe(self) -> str:
        return f"{self.inner.describe()} over buckets of {self.size}"

    def min_updates(self) -> int:
        # ceil(n / s) >= m  <=>  n >= (m - 1) s + 1
        return (self.inner.min_updates() - 1) * self.size + 1

    def _requirement(self) -> str:
        return (f"at least {self.inner.min_updates()} buckets of {self.size}, so at least "
                f"{self.min_updates()}")

    def _advice(self) -> str:
        return f"{self.inner._advice()}, or lower aggregation.bucketing"

    def begin(self, *, version: int, center: np.ndarray | None) -> None:
        self.version = int(version)
        self.inner = self.inner.__copy__()  # this aggregation's own inner state
        self.inner.begin(version=version, center=center)

    def order(self, n: int) -> np.ndarray:
        """This aggregation's random order of ``n`` updates."""
        return np.random.default_rng([self.seed, self.version, _STREAM]).permutation(n)

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        means, weights = bucket_means(x, w, self.order(x.shape[0]), self.size)
        return self.inner._combine(means, weights)
