"""Randomized Hadamard rotation ``x -> H D x / sqrt(d)`` with a shared seed.

Before integer rounding, distributed DP flattens each update so that no coordinate
carries much more than ``norm / sqrt(d)``; that keeps the modular sum within range.
``D`` is a diagonal of random signs drawn from ``seed``; the rotation is orthonormal, so
the server undoes it on the sum with the same seed. The seed must be shared by all
clients of a round and the server; it need not be secret.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from privacy.dp import _checks


def padded_dim(dim: int) -> int:
    """Smallest power of two >= ``dim``."""
    dim = _checks.integer("dim", dim, 1)
    return 1 << (dim - 1).bit_length()


def fwht_(x: np.ndarray) -> np.ndarray:
    """In-place unnormalised fast Walsh-Hadamard transform of a contiguous 1-D float64 array
    whose length is a power of two (Sylvester order: ``H`` is symmetric, ``H @ H = n I``)."""
    n = x.shape[0]
    if n & (n - 1):
        raise ValueError(f"length must be a power of two, got {n}")
    if x.ndim != 1 or x.dtype != np.float64 or not x.flags.c_contiguous:
        raise ValueError(f"expected a contiguous 1-D float64 array, got {x.dtype} {x.shape}")
    _fwht(x)
    return x


_BLOCK = 1 << 12  # 32 KB of float64: the first levels run block by block in cache


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _fwht(x):  # types: numba infers them per call
    """The butterflies of :func:`fwht_`, level by level (the levels below ``_BLOCK`` one
    cache-sized block at a time); each output is the same sum of the same terms."""
    n = x.size
    block = min(n, _BLOCK)
    for start in range(0, n, block):
        h = 1
        while h < block:
            for i in range(start, start + block, 2 * h):
                for j in range(i, i + h):
                    a, b = x[j], x[j + h]
                    x[j], x[j + h] = a + b, a - b
            h *= 2
    h = block
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                a, b = x[j], x[j + h]
                x[j], x[j + h] = a + b, a - b
        h *= 2


class RandomizedHadamard:
    """Orthonormal rotation of ``dim``-vectors into ``padded_dim`` coordinates."""

    def __init__(self, dim: int, seed: int) -> None:
        self.dim = _checks.integer("dim", dim, 1)
        self.padded_dim = padded_dim(dim)
        seed = _checks.integer("rotation seed", seed, 0)
        bits = np.random.default_rng(seed).integers(0, 2, self.padded_dim, dtype=np.int8)
        self._signs = (2.0 * bits - 1.0).astype(np.float64)
        self._norm = 1.0 / math.sqrt(self.padded_dim)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Rotate a ``dim``-vector; returns a new float64 ``padded_dim``-vector."""
        x = np.ravel(x)
        if x.size != self.dim:
            raise ValueError(f"expected a vector of length {self.dim}, got {x.size}")
        y = np.zeros(self.padded_dim, dtype=np.float64)
        y[: self.dim] = x
        y *= self._signs
        fwht_(y)
        y *= self._norm
        return y

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """Undo :meth:`forward`; returns a new float64 ``dim``-vector."""
        y = np.ravel(y)
        if y.size != self.padded_dim:
            raise ValueError(f"expected a vector of length {self.padded_dim}, got {y.size}")
        x = np.array(y, dtype=np.float64)
        fwht_(x)
        x *= self._norm
        x *= self._signs
        return x[: self.dim].copy()
