"""Adaptive robust clipping (ARC; Allouah, Guerraoui, Gupta, Pinot, Rizk, NeurIPS 2024,
"Boosting Robustness by Clipping Gradients in Distributed Learning").

Before a robust combine, the ``k = floor(2 (f / n) (n - f))`` updates of largest norm are
scaled down to the norm of the ``(k + 1)``-th largest; the others pass as they are.
With ``f <= n / 2`` Byzantine updates, ``k >= f``, so at least one of the ``k + 1``
largest is honest and the radius is at most the largest honest norm: however the
Byzantine updates choose their norms, none ends above every honest one, while most honest
updates pass untouched (the radius follows them each round; nothing to tune). It takes
out what a few huge vectors (noise, scaling) do to a distance-based step after it: they
no longer dominate every distance, so nearest-neighbour mixing and centered clipping see
them at an honest scale.

Weights pass unchanged; the clip is around 0 (the update's own norm), so it needs no
centre. Order in the pipeline: ARC first, on the raw updates, then nearest-neighbour
mixing, bucketing and the combine.
"""

from __future__ import annotations

import numpy as np

from aggregation.robust import PreStep, RobustCombine, integer_param

__all__ = ["ARC", "arc_clip", "arc_count"]


def arc_count(n: int, f: int) -> int:
    """How many updates ARC clips among ``n`` with ``f`` Byzantine: ``floor(2 (f/n)(n - f))``
    (0 when ``n`` is 0), in integers so that no rounding moves it."""
    if n <= 0:
        return 0
    return max(0, 2 * f * (n - f) // n)


def arc_clip(x: np.ndarray, f: int) -> tuple[np.ndarray, int, float]:
    """The rows of ``x`` (``n x d``) with the :func:`arc_count` largest-norm rows scaled to
    the norm of the next largest; returns the clipped rows (a new array, ``x`` unchanged),
    how many rows were clipped and the radius (``inf`` when none is)."""
    n = x.shape[0]
    k = min(arc_count(n, f), n - 1)
    if k <= 0:
        return x, 0, float("inf")
    xs = x.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", xs, xs))
    order = np.argsort(-norms, kind="stable")  # largest first, ties to the lower index
    radius = float(norms[order[k]])
    top = order[:k]
    with np.errstate(divide="ignore"):
        scale = np.where(norms[top] > radius, radius / norms[top], 1.0)
    out = np.array(x, dtype=x.dtype)
    out[top] = (xs[top] * scale[:, None]).astype(x.dtype)
    return out, k, radius


class ARC(PreStep):
    """``inner`` (a robust combine, possibly after mixing or bucketing) applied to the
    updates after adaptive robust clipping with ``f`` Byzantine (:func:`arc_clip`)."""

    def __init__(self, inner: RobustCombine, f: int) -> None:
        super().__init__(inner)
        self.f = integer_param("f", f, minimum=1)

    def describe(self) -> str:
        return f"{self.inner.describe()} after adaptive robust clipping"

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        clipped, _, _ = arc_clip(x, self.f)
        return self.inner._combine(clipped, w)
