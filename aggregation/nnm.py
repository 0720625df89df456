"""Nearest-neighbour mixing (NNM; Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan,
AISTATS 2023, "Fixing by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity").

Before a robust combine, each update ``x_i`` is replaced by the mean of its ``n - f``
nearest updates in Euclidean distance, itself included. With at most ``f`` Byzantine
updates, every honest update's mix holds at least ``n - 2f`` honest ones, so the mixed
honest updates are closer together than the raw ones (the paper's point on label-skewed
data) while a Byzantine update's own mix is pulled towards honest ones. The combine then
runs on the ``n`` mixes as it would on the updates.

Cost: one ``n x n`` distance matrix (the Gram product,
:func:`aggregation.robust.pairwise_sq_distances`) and one ``n x n`` by ``n x d`` product
for the means, ``O(n^2 d)``.

Weights: the mix is the plain mean of the neighbours, as in the paper, so a large claimed
weight cannot pull the mixes of honest updates; each mix carries the mean of its
neighbours' weights into the combine (uniform weights stay uniform).

With bucketing, NNM runs first, on the raw updates: the paper's guarantee is for ``f``
Byzantine among the ``n`` inputs it mixes, which holds for the raw updates with
``aggregation.f``, while bucket means would need ``f`` counted in buckets (up to ``f`` of
``n / s``, leaving ``n / s - f`` neighbours, often none); the buckets then average
mixes, which only lowers their spread further.
"""

from __future__ import annotations

import numpy as np

from aggregation.robust import (
    GRAM_BLOCK,
    PreStep,
    RobustCombine,
    integer_param,
    pairwise_sq_distances,
)

__all__ = ["NNM", "nearest_neighbours", "nnm_mix"]


def nearest_neighbours(dist: np.ndarray, k: int) -> np.ndarray:
    """For each row of the ``n x n`` squared distances, the indices of its ``k`` nearest
    rows, itself first (even when another row lies at distance 0); ties go to the lower
    index."""
    ranked = dist.copy()
    np.fill_diagonal(ranked, -1.0)  # itself first, whatever the ties at 0
    return np.argsort(ranked, axis=1, kind="stable")[:, :k]


def nnm_mix(x: np.ndarray, w: np.ndarray, f: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``x`` (``n x d``) replaced by the mean of its ``n - f`` nearest rows, and
    each weight by the mean of those rows' weights."""
    n, d = x.shape
    k = n - f
    if k < 1:
        raise ValueError(f"nearest-neighbour mixing of {n} updates with f={f} mixes "
                         f"{k} updates: it needs more than f")
    near = nearest_neighbours(pairwise_sq_distances(x), k)
    mix = np.zeros((n, n), dtype=np.float64)
    np.put_along_axis(mix, near, 1.0 / k, axis=1)
    out = np.empty((n, d), dtype=np.float32)
    step = max(1024, GRAM_BLOCK // max(n, 1))
    for start in range(0, d, step):
        out[:, start:start + step] = mix @ x[:, start:start + step].astype(np.float64)
    return out, mix @ np.asarray(w, dtype=np.float64)


class NNM(PreStep):
    """``inner`` (a robust combine, or bucketing over one) applied to the updates mixed
    with their ``n - f`` nearest neighbours (:func:`nnm_mix`)."""

    def __init__(self, inner: RobustCombine, f: int) -> None:
        super().__init__(inner)
        self.f = integer_param("f", f, minimum=1)

    def describe(self) -> str:
        return f"{self.inner.describe()} after nearest-neighbour mixing"

    def min_updates(self) -> int:
        return max(self.inner.min_updates(), self.f + 1)

    def _requirement(self) -> str:
        if self.inner.min_updates() > self.f:
            return self.inner._requirement()
        return f"more than f = {self.f}"

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        mixed, weights = nnm_mix(x, w, self.f)
        return self.inner._combine(mixed, weights)
