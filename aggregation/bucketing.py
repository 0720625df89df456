"""Bucketing (Karimireddy, He, Jaggi, ICLR 2022, "Byzantine-robust learning on
heterogeneous datasets via bucketing"): before a robust combine, the updates are put in a
random order, split into buckets of ``s`` consecutive ones (the last may be smaller) and
each bucket is replaced by its weighted mean, with the bucket's total weight. The robust
combine then sees ``ceil(n / s)`` means that are more alike than the updates themselves,
which is what keeps it from discarding honest but unusual updates on non-IID data.

The order is drawn from the run seed and the model version the aggregation is against
(the round, in rounds that each apply an aggregate), so a resumed run draws the same.

The bucket size is bounded by the attacker fraction: with ``f`` of ``n`` updates
Byzantine (``delta = f / n``), buckets of ``s`` hold an attacker in up to ``f`` of the
``n / s`` buckets, a fraction ``delta s``, which must stay below the combine's breakdown
point of one half: ``s <= 1 / (2 delta)`` (:func:`bucket_bound`). ``size=None`` picks
the largest size within that bound in each aggregation, from the number of updates it
got (:func:`auto_bucket_size`).
"""

from __future__ import annotations

import math

import numpy as np

from aggregation.robust import RobustCombine, integer_param

__all__ = ["Bucketing", "auto_bucket_size", "bucket_bound", "bucket_means"]

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


def bucket_bound(n: int, f: int) -> float:
    """The largest bucket size ``1 / (2 delta) = n / (2 f)`` for ``f`` Byzantine of ``n``
    updates (infinite for ``f = 0``)."""
    return math.inf if f == 0 else n / (2 * f)


def auto_bucket_size(n: int, f: int, need: int = 1) -> int:
    """The largest ``s <= n / (2 f)`` (at least 1) that still leaves ``need`` buckets of
    the ``n`` updates (``ceil(n / s) >= need``)."""
    if f < 1:
        raise ValueError(f"the bucket size from the attacker fraction needs f >= 1, got {f}")
    s = max(1, n // (2 * f))
    while s > 1 and math.ceil(n / s) < need:
        s -= 1
    return s


class Bucketing(RobustCombine):
    """``inner`` applied to the means of random buckets of ``size`` updates; ``size``
    None: in each aggregation, :func:`auto_bucket_size` of its updates and ``f``."""

    def __init__(self, inner: RobustCombine, size: int | None, seed: int = 0,
                 f: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.f = integer_param("f", f)
        if size is None and self.f < 1:
            raise ValueError("aggregation.bucketing = -1 sizes buckets from the attacker "
                             "fraction aggregation.f / n, but aggregation.f = 0: set "
                             "aggregation.f >= 1 (the attackers defended against); otherwise "
                             "aggregation.bucketing must be >= 0 (the bucket size; 0 or 1: "
                             "no bucketing)")
        self.size = None if size is None else \
            integer_param("aggregation.bucketing", size, minimum=2)
        self.seed = integer_param("seed", seed)
        self.version = 0
        self.needs_center = inner.needs_center

    def describe(self) -> str:
        if self.size is None:
            return f"{self.inner.describe()} over buckets of n / (2 f) = n / {2 * self.f}"
        return f"{self.inner.describe()} over buckets of {self.size}"

    def min_updates(self) -> int:
        if self.size is None:  # the size drops to 1 before there are too few buckets
            return self.inner.min_updates()
        # ceil(n / s) >= m  <=>  n >= (m - 1) s + 1
        return (self.inner.min_updates() - 1) * self.size + 1

    def _requirement(self) -> str:
        if self.size is None:
            return self.inner._requirement()
        return (f"at least {self.inner.min_updates()} buckets of {self.size}, so at least "
                f"{self.min_updates()}")

    def check(self, n_clients: int) -> None:
        """Also refuse a fixed size above :func:`bucket_bound` for ``n_clients`` (first:
        lowering the size is the fix)."""
        bound = bucket_bound(n_clients, self.f)
        if self.size is not None and self.size > bound:
            fix = f"<= {math.floor(bound)}" if bound >= 2 else "= 0"
            raise ValueError(
                f"aggregation.bucketing = {self.size} exceeds 1 / (2 f / n) = {bound:g} for "
                f"aggregation.f = {self.f} attackers among {n_clients} updates per "
                f"aggregation: buckets holding an attacker could make up f s / n = "
                f"{self.f * self.size / n_clients:.2f} of the buckets, more than one half, "
                f"and outvote the honest ones; set aggregation.bucketing {fix}, or -1 to "
                "pick the size from aggregation.f")
        super().check(n_clients)

    def size_for(self, n: int) -> int:
        """The bucket size of an aggregation of ``n`` updates."""
        if self.size is None:
            return auto_bucket_size(n, self.f, self.inner.min_updates())
        return self.size

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
        means, weights = bucket_means(x, w, self.order(x.shape[0]), self.size_for(x.shape[0]))
        return self.inner._combine(means, weights)
