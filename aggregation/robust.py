"""Byzantine-robust combine stages (median, trimmed mean, Krum, Multi-Krum, Bulyan) and
norm bounding.

These combines are not linear: they keep every added delta (one float32 copy each, in an
``N x d`` matrix) and work on the whole set in :meth:`Combine.result`, so they cannot run
under secure aggregation or over a ring. Krum, Multi-Krum and Bulyan assume at most ``f``
Byzantine updates and need enough updates for that; :meth:`RobustCombine.check` says so
when a run is configured and ``result()`` raises ``ValueError`` when an aggregation got
too few accepted updates.

Coordinate-wise order statistics sort the ``N x d`` matrix along the client axis in place:
with numpy's SIMD sorts this is several times faster than ``np.partition`` or ``np.median``
for the client counts of federated rounds, and one sort serves the median, the trim and
Bulyan's closest-to-median window at once.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

import numpy as np

from aggregation.combine import Combine
from aggregation.stages import Clip

__all__ = [
    "Bulyan", "CoordinateMedian", "Krum", "MultiKrum", "NormBound", "PreStep", "RobustCombine",
    "TrimmedMean", "integer_param", "krum_scores", "pairwise_sq_distances",
]

GRAM_BLOCK = 1 << 18  # float64 elements per column block of the Gram product (~2 MB)


def integer_param(name: str, value: object, minimum: int = 0) -> int:
    """An integer parameter (integral floats from config files accepted) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Single-threaded BLAS while the context is open (process-wide): an N x N Gram product
    is memory-bound, and BLAS threads on oversubscribed cores made it ~10x slower."""
    try:
        from threadpoolctl import threadpool_limits  # via scikit-learn; optional
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def pairwise_sq_distances(x: np.ndarray) -> np.ndarray:
    """Squared L2 distances between the rows of ``x`` (``N x d``) as an ``N x N`` float64.

    Uses ``|a - b|^2 = |a|^2 + |b|^2 - 2 a.b`` with the Gram matrix accumulated in float64
    over column blocks (bounded extra memory); rounding negatives are clipped to 0 and
    the diagonal is exactly 0. For deltas, whose norms are comparable to their distances,
    the formula's cancellation is negligible in float64.
    """
    n, d = x.shape
    gram = np.zeros((n, n), dtype=np.float64)
    step = max(1024, GRAM_BLOCK // max(n, 1))
    with _one_blas_thread():
        for start in range(0, d, step):
            block = x[:, start:start + step].astype(np.float64)
            gram += block @ block.T
    sq = np.diag(gram).copy()
    dist = sq[:, None] + sq[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Krum score of each update: sum of squared distances to its ``n - f - 2`` closest others.

    As in Flower, at least 1 neighbour is used (this matters only inside Bulyan's iterated
    selection, where the remaining set can get smaller than ``f + 3``); never more than
    ``n - 1``.
    """
    n = dist.shape[0]
    k = min(max(1, n - f - 2), n - 1)
    if k <= 0:
        return np.zeros(n)
    others = dist + np.diag(np.full(n, np.inf))
    return np.partition(others, k - 1, axis=1)[:, :k].sum(axis=1)


class RobustCombine(Combine):
    """Base of the non-linear combines: keeps the added deltas and their weights."""

    linear = False

    def __init__(self) -> None:
        self._dim: int | None = None
        self._buf = np.empty((0, 0), dtype=np.float32)
        self._n = 0
        self._weights: list[float] = []

    # -- what each combine needs ---------------------------------------------------------
    def min_updates(self) -> int:
        """The fewest updates this combine can aggregate."""
        return 1

    def _requirement(self) -> str:
        return f"at least {self.min_updates()}"

    def _advice(self) -> str:
        return "sample more clients"

    def describe(self) -> str:
        return type(self).__name__

    def _too_few(self, n: int, unit: str) -> str:
        return (f"{self.describe()} needs {self._requirement()} {unit}, got {n}: "
                f"{self._advice()}")

    def check(self, n_clients: int) -> None:
        """Raise ValueError when ``n_clients`` per round can never be enough (config time)."""
        if n_clients < self.min_updates():
            raise ValueError(self._too_few(n_clients, "clients per round"))

    def _require(self, n: int) -> None:
        if n < self.min_updates():
            raise ValueError(self._too_few(n, "updates per aggregation"))

    # -- Combine -------------------------------------------------------------------------
    def start(self, dim: int) -> None:
        self._dim = int(dim)
        self._buf = np.empty((0, self._dim), dtype=np.float32)
        self._n = 0
        self._weights = []

    def add(self, delta: np.ndarray, weight: float) -> None:
        if self._dim is None:
            raise RuntimeError("start() first")
        if np.shape(delta) != (self._dim,):
            raise ValueError(f"delta shape is {np.shape(delta)}, expected ({self._dim},)")
        if self._n == self._buf.shape[0]:
            # Amortised doubling; untouched rows of np.empty cost no physical memory.
            grown = np.empty((max(4, 2 * self._n), self._dim), dtype=np.float32)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n] = delta  # a copy: later changes to ``delta`` do not leak in
        self._weights.append(float(weight))
        self._n += 1

    @property
    def count(self) -> int:
        """Number of deltas added since start()."""
        return self._n

    def result(self) -> np.ndarray | None:
        if self._dim is None or self._n == 0:
            return None
        self._require(self._n)
        return self._combine(self._buf[:self._n], np.asarray(self._weights))

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _sorted_median(s: np.ndarray) -> np.ndarray:
    """Median of each column of a column-sorted matrix (mean of the middle two if even)."""
    n = s.shape[0]
    if n % 2:
        return s[n // 2].copy()
    # 0.5a + 0.5b == (a + b) / 2 exactly in binary floating point, without overflow.
    return np.float32(0.5) * s[n // 2 - 1] + np.float32(0.5) * s[n // 2]



class PreStep(RobustCombine):
    """A step on the updates before ``inner`` (clipping, mixing), which combines what the
    step makes of them: needs, advice and checks are ``inner``'s unless a step adds its own."""

    def __init__(self, inner: RobustCombine) -> None:
        super().__init__()
        self.inner = inner
        self.needs_center = inner.needs_center

    def min_updates(self) -> int:
        return self.inner.min_updates()

    def _requirement(self) -> str:
        return self.inner._requirement()

    def _advice(self) -> str:
        return self.inner._advice()

    def begin(self, *, version: int, center: np.ndarray | None) -> None:
        self.inner = self.inner.__copy__()  # this aggregation's own inner state
        self.inner.begin(version=version, center=center)

    def check(self, n_clients: int) -> None:
        super().check(n_clients)
        self.inner.check(n_clients)


class CoordinateMedian(RobustCombine):
    """Coordinate-wise median (Yin et al. 2018); the mean of the two middle values when N is
    even, as ``np.median`` and Flower's FedMedian. Weights are ignored: every accepted
    update counts once, whatever its example count or staleness weight.
    """

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        x.sort(axis=0)
        return _sorted_median(x)


class TrimmedMean(RobustCombine):
    """Coordinate-wise beta-trimmed mean (Yin et al. 2018), weights ignored.

    Per coordinate, drops the ``k = floor(beta * N)`` largest and ``k`` smallest values and
    averages the remaining ``N - 2k``. The paper assumes ``beta * N`` is an integer; flooring
    is Flower's FedTrimmedAvg (and ``scipy.stats.trim_mean``) choice, so with
    ``beta * N < 1`` nothing is trimmed.
    """

    def __init__(self, beta: float) -> None:
        super().__init__()
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or \
                not 0.0 <= float(beta) < 0.5:
            raise ValueError(f"trimmed mean beta must be in [0, 0.5), got {beta!r}")
        self.beta = float(beta)

    def describe(self) -> str:
        return f"TrimmedMean with beta={self.beta:g}"

    def trim_count(self, n: int) -> int:
        """How many values are dropped at each end of each coordinate among ``n``."""
        return int(self.beta * n)

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        k = self.trim_count(n)
        if k == 0:
            return x.mean(axis=0, dtype=np.float32)
        x.sort(axis=0)
        return x[k:n - k].mean(axis=0, dtype=np.float32)


class Krum(RobustCombine):
    """Krum (Blanchard et al. 2017): the update with the lowest score, where the score is
    the sum of squared distances to its ``n - f - 2`` closest other updates.

    Needs ``n > 2f + 2`` updates. Weights are ignored (the chosen update is returned as is);
    ties go to the update added first.
    """

    def __init__(self, f: int) -> None:
        super().__init__()
        self.f = integer_param("f", f)

    def describe(self) -> str:
        return f"Krum with f={self.f}"

    def min_updates(self) -> int:
        return 2 * self.f + 3

    def _requirement(self) -> str:
        return f"more than {2 * self.f + 2}"

    def _advice(self) -> str:
        return "lower f or sample more clients"

    def scores(self) -> np.ndarray:
        """Krum scores of the updates added so far (for logging and tests)."""
        return krum_scores(pairwise_sq_distances(self._buf[:self._n]), self.f)

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        best = int(np.argmin(krum_scores(pairwise_sq_distances(x), self.f)))
        return x[best].copy()


class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al. 2017): average of the ``m`` updates with the lowest Krum
    scores (``m = n - f`` when None, the paper's choice).

    The average is weighted by the pipeline's weights, as Flower's MultiKrum (and legacy
    ``aggregate_krum``) weights by example count; the paper's plain mean is
    ``Weight(by="uniform")`` in front of it. ``m <= n - f`` is required: with ``f`` Byzantine
    updates, selecting more than ``n - f`` would force at least one of them into the average.
    """

    def __init__(self, f: int, m: int | None = None) -> None:
        super().__init__(f)
        self.m = None if m is None else integer_param("m", m, minimum=1)

    def describe(self) -> str:
        return f"Multi-Krum with f={self.f}" + ("" if self.m is None else f", m={self.m}")

    def min_updates(self) -> int:
        return max(2 * self.f + 3, (self.m or 0) + self.f)

    def _requirement(self) -> str:
        if self.m is not None and self.m + self.f > 2 * self.f + 3:
            return f"at least m + f = {self.m + self.f}"
        return f"more than {2 * self.f + 2}"

    def _advice(self) -> str:
        return "lower f or sample more clients" if self.m is None else \
            "lower m or f, or sample more clients"

    def selected(self, x: np.ndarray) -> np.ndarray:
        """Indices of the ``m`` lowest-score rows of ``x``, best first (stable on ties)."""
        self._require(x.shape[0])
        m = x.shape[0] - self.f if self.m is None else self.m
        scores = krum_scores(pairwise_sq_distances(x), self.f)
        return np.argsort(scores, kind="stable")[:m]

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        idx = self.selected(x)
        total = float(w[idx].sum())
        acc = np.zeros(x.shape[1], dtype=np.float64)
        for i in idx:
            acc += (w[i] / total) * x[i]
        return acc.astype(np.float32)


class Bulyan(RobustCombine):
    """Bulyan (El Mhamdi et al. 2018) over Krum, weights ignored. Needs ``n >= 4f + 3``.

    1. Select ``theta = n - 2f`` updates. ``selection="iterated"`` (the paper, and Flower's
       legacy ``aggregate_bulyan``): apply Krum to the remaining set ``theta`` times,
       moving the winner into the selection each time. ``selection="multikrum"`` (Flower's
       ``serverapp`` Bulyan default): the ``theta`` lowest Krum scores of the full set.
    2. Per coordinate, average the ``beta = theta - 2f`` selected values closest to the
       selected values' median.

    Ties go to the update added first. In the iterated selection they are structural: once
    ``f + 3`` updates remain, scores use one neighbour and mutual nearest neighbours tie, so
    the result can depend on arrival order (as in the paper and in Flower).

    The ``beta`` closest values of a sorted column form a contiguous window, so step 2 sorts
    the selection once and picks, per coordinate, the window of the ``2f + 1`` candidates
    whose farther end is closest to the median (ties: the lower window).
    """

    SELECTIONS = ("iterated", "multikrum")

    def __init__(self, f: int, selection: str = "iterated") -> None:
        super().__init__()
        self.f = integer_param("f", f)
        if selection not in self.SELECTIONS:
            raise ValueError(f"Bulyan selection must be one of {', '.join(self.SELECTIONS)}, "
                             f"got {selection!r}")
        self.selection = selection

    def describe(self) -> str:
        return f"Bulyan with f={self.f}"

    def min_updates(self) -> int:
        return 4 * self.f + 3

    def _advice(self) -> str:
        return "lower f or sample more clients"

    def selected(self, x: np.ndarray) -> np.ndarray:
        """Indices of the ``theta`` rows of ``x`` chosen in step 1, in order of choice."""
        n = x.shape[0]
        self._require(n)
        theta = n - 2 * self.f
        dist = pairwise_sq_distances(x)
        if self.selection == "multikrum":
            return np.argsort(krum_scores(dist, self.f), kind="stable")[:theta]
        remaining = np.arange(n)
        chosen: list[int] = []
        for _ in range(theta):
            sub = dist[np.ix_(remaining, remaining)]
            pick = int(np.argmin(krum_scores(sub, self.f)))
            chosen.append(int(remaining[pick]))
            remaining = np.delete(remaining, pick)
        return np.asarray(chosen, dtype=np.intp)

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        s = x[self.selected(x)]  # a copy, sorted in place below
        theta = s.shape[0]
        beta = theta - 2 * self.f
        s.sort(axis=0)
        med = _sorted_median(s)
        # Window [start, start + beta) with the smallest max distance to the median.
        best_cost = np.full(s.shape[1], np.inf, dtype=np.float32)
        best_start = np.zeros(s.shape[1], dtype=np.intp)
        for start in range(theta - beta + 1):
            cost = np.maximum(med - s[start], s[start + beta - 1] - med)
            better = cost < best_cost
            best_start[better] = start
            np.minimum(best_cost, cost, out=best_cost)
        # Sum each column's window; rows [theta - beta, beta), if any, lie in every window.
        acc = np.zeros(s.shape[1], dtype=np.float32)
        best_end = best_start + beta
        for row in range(theta):
            if theta - beta <= row < beta:
                acc += s[row]
            else:
                acc += np.where((best_start <= row) & (row < best_end), s[row], np.float32(0))
        acc *= np.float32(1.0 / beta)
        return acc


class NormBound(Clip):
    """Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?"):
    ``delta * min(1, max_norm / |delta|)``.

    This is exactly :class:`aggregation.stages.Clip`; the subclass only gives it the
    paper's name and parameter. Put it before the combine (any combine, robust or not).
    """

    def __init__(self, max_norm: float) -> None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or \
                not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
        super().__init__(clip=float(max_norm))

    @property
    def max_norm(self) -> float:
        return self.clip

    def __repr__(self) -> str:
        return f"NormBound(max_norm={self.clip!r})"
