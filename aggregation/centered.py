"""Centered clipping and the geometric median: robust combines that need no sort.

- :class:`CenteredClip` (Karimireddy, He, Jaggi, ICML 2021, "Learning from History for
  Byzantine Robust Optimization"): starting from the centre ``v`` (the previous round's
  aggregate, which the pipeline keeps and checkpoints), repeat ``iterations`` times
  ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i`` with
  ``clip_tau(z) = z * min(1, tau / |z|)``. The paper's mean is the uniform case
  (``aggregation.weight_by = "uniform"``).
- :class:`GeometricMedian` (RFA, Pillutla, Kakade, Harchaoui 2022): the smoothed
  Weiszfeld algorithm, ``beta_i = alpha_i / max(nu, |v - x_i|)``,
  ``v <- sum_i beta_i x_i / sum_i beta_i``, from the weighted mean.
- :func:`clip_around`: one client's share of centered clipping, ``v + clip_tau(x - v)``;
  the mean of these over the clients is one iteration of the server's rule, so it runs
  under secure aggregation, where the server only learns the sum.

Both tolerate fewer than half Byzantine inputs: with ``f`` of them they need ``2f + 1``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from aggregation.robust import RobustCombine, integer_param

__all__ = ["CenteredClip", "GeometricMedian", "clip_around", "median_radius"]


def _finite_positive(name: str, value: object, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(float(value)) or float(value) < 0 or \
            (float(value) == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                         f"got {value!r}")
    return float(value)


def median_radius(distances: np.ndarray) -> float:
    """The automatic clipping radius: the median distance of the inputs to the centre.

    The paper's analysis sets tau in proportion to how far the good inputs lie from the
    centre (their spread plus the centre's error, ``sqrt(rho^2 + |v - mean|^2)``); the
    median distance estimates that scale from all the inputs while fewer than half are
    Byzantine, whatever their values, and adapts as the updates shrink over training.
    """
    return float(np.median(distances))


class _Majority(RobustCombine):
    """A combine that tolerates ``f < n / 2`` Byzantine inputs: needs ``2f + 1``."""

    def __init__(self, f: int = 0) -> None:
        super().__init__()
        self.f = integer_param("f", f)

    def min_updates(self) -> int:
        return 2 * self.f + 1

    def _advice(self) -> str:
        return "lower aggregation.f or sample more clients"


class CenteredClip(_Majority):
    """Centered clipping around the previous aggregate (see the module docstring).

    ``radius`` 0 picks tau in each iteration as ``scale`` times :func:`median_radius` of
    the distances to the current centre; a positive ``radius`` fixes tau, as the paper's
    code does (``scale`` must then be 1). Without a previous aggregate (the first round)
    the centre is 0.

    ``late_iterations`` (None: off): once ``late_after`` aggregates have been applied (an
    aggregation against model version >= ``late_after``: in sync rounds, the rounds after
    round ``late_after``), each aggregation runs that many iterations instead of
    ``iterations``: many early, while the centre is far from the updates, fewer once it
    follows them. The choice depends on the version alone, so a resumed run makes the
    same one.
    """

    needs_center = True

    def __init__(self, radius: float = 0.0, iterations: int = 3, f: int = 0,
                 scale: float = 1.0, late_iterations: int | None = None,
                 late_after: int = 0) -> None:
        super().__init__(f)
        self.radius = _finite_positive("clip_radius", radius, zero_ok=True)
        self.iterations = integer_param("clip_iterations", iterations, minimum=1)
        self.scale = _finite_positive("clip_scale", scale)
        if self.radius and self.scale != 1.0:
            raise ValueError(f"clip_scale = {scale:g} scales the automatic radius (the median "
                             f"distance), but clip_radius = {radius:g} fixes the radius: set "
                             "clip_scale = 1 or clip_radius = 0")
        self.late_iterations = None if late_iterations is None else \
            integer_param("clip_iterations_late", late_iterations, minimum=1)
        self.late_after = integer_param("clip_late_after", late_after)
        self.center: np.ndarray | None = None
        self.version = 0

    def describe(self) -> str:
        return f"centered clipping with f={self.f}"

    def begin(self, *, version: int, center: np.ndarray | None) -> None:
        self.center = center
        self.version = int(version)

    def iterations_at(self, version: int) -> int:
        """How many iterations an aggregation against model ``version`` runs."""
        if self.late_iterations is not None and version >= self.late_after:
            return self.late_iterations
        return self.iterations

    def radius_of(self, dist: np.ndarray) -> float:
        """tau for one iteration, given the inputs' distances to the current centre."""
        return self.radius or self.scale * median_radius(dist)

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        v = np.zeros(x.shape[1], dtype=np.float64) if self.center is None \
            else np.array(self.center, dtype=np.float64)
        share = w / w.sum()
        for _ in range(self.iterations_at(self.version)):
            diff = x - v  # float64, N x d
            dist = np.sqrt(np.einsum("ij,ij->i", diff, diff))
            tau = self.radius_of(dist)
            with np.errstate(over="ignore"):  # an input at the centre: tau / tiny = inf
                scale = np.minimum(1.0, tau / np.maximum(dist, np.finfo(np.float64).tiny))
            v = v + (share * scale) @ diff
        return v.astype(np.float32)


class GeometricMedian(_Majority):
    """RFA's smoothed Weiszfeld (see the module docstring), ``iterations`` steps from the
    weighted mean; ``nu`` > 0 keeps a step finite when the estimate hits an input."""

    def __init__(self, nu: float = 1e-6, iterations: int = 8, f: int = 0) -> None:
        super().__init__(f)
        self.nu = _finite_positive("gm_nu", nu)
        self.iterations = integer_param("gm_iterations", iterations, minimum=1)

    def describe(self) -> str:
        return f"geometric median with f={self.f}"

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        alpha = w / w.sum()
        xs = x.astype(np.float64)
        v = alpha @ xs
        for _ in range(self.iterations):
            diff = xs - v
            dist = np.sqrt(np.einsum("ij,ij->i", diff, diff))
            beta = alpha / np.maximum(self.nu, dist)
            v = (beta @ xs) / beta.sum()
        return v.astype(np.float32)


def clip_around(delta: np.ndarray, center: np.ndarray, radius: float) -> np.ndarray:
    """``center + clip_radius(delta - center)``, written into ``delta``; returns it.

    A client's step of centered clipping: it needs only the public centre, so the mean of
    what the clients send is one iteration of :class:`CenteredClip` with a fixed radius.
    """
    _finite_positive("clip radius", radius)
    diff = delta.astype(np.float64) - center
    norm = math.sqrt(float(diff @ diff))
    if norm > radius:
        diff *= radius / norm
    np.add(center, diff, out=delta, casting="unsafe")
    return delta
