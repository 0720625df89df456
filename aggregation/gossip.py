"""Gossip averaging's topology and mixing weights (D-PSGD, Lian et al. NeurIPS 2017).

Each round node ``i`` replaces its model by ``x_i = sum_j W_ij x_j`` over itself and its
neighbours. ``W`` is symmetric and doubly stochastic (rows and columns sum to 1), so the
mean of the models is preserved and, on a connected graph, the models contract to it.
The weights are Metropolis–Hastings's: ``W_ij = 1 / (1 + max(d_i, d_j))`` on an edge,
``W_ii = 1 - sum_j W_ij``, which needs only the degrees of the two ends.

Topologies (over ranks ``0..n-1``): ``ring`` (each rank's neighbours are ``r - 1`` and
``r + 1`` mod n), and ``random``: a seeded random Hamiltonian cycle (so the graph is
connected) plus random extra edges between ranks still below ``degree`` until none can
be added; every rank has at least 2 and at most ``max(degree, 2)`` neighbours (a complete
graph once ``degree >= n - 1``). Pure numpy: no torch, no I/O.
"""

from __future__ import annotations

import numpy as np

TOPOLOGIES = ("ring", "random")

Adjacency = list[frozenset[int]]  # rank -> its neighbours (never itself)


def ring_topology(n: int) -> Adjacency:
    """Each rank's neighbours on a ring of ``n`` (one for n = 2, none for n = 1)."""
    if n < 1:
        raise ValueError(f"a topology needs at least one node, got {n}")
    return [frozenset({(r - 1) % n, (r + 1) % n} - {r}) for r in range(n)]


def random_topology(n: int, degree: int, seed: int | list[int]) -> Adjacency:
    """A seeded random connected graph on ``n`` ranks: a random Hamiltonian cycle plus
    random edges between ranks of degree below ``degree`` (see the module docstring)."""
    if degree < 2:
        raise ValueError(f"a random topology needs degree >= 2, got {degree}")
    if n <= 3 or degree >= n - 1:
        return [frozenset(set(range(n)) - {r}) for r in range(n)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for a, b in zip(order, np.roll(order, -1), strict=True):
        nbrs[int(a)].add(int(b))
        nbrs[int(b)].add(int(a))
    candidates = [(i, j) for i in range(n) for j in range(i + 1, n) if j not in nbrs[i]]
    for k in rng.permutation(len(candidates)):
        i, j = candidates[int(k)]
        if len(nbrs[i]) < degree and len(nbrs[j]) < degree:
            nbrs[i].add(j)
            nbrs[j].add(i)
    return [frozenset(s) for s in nbrs]


def topology(kind: str, n: int, *, degree: int = 4, seed: int | list[int] = 0) -> Adjacency:
    """The ``kind`` topology ("ring" or "random") on ``n`` ranks."""
    if kind == "ring":
        return ring_topology(n)
    if kind == "random":
        return random_topology(n, degree, seed)
    raise ValueError(f"unknown topology '{kind}'; choose one of: {', '.join(TOPOLOGIES)}")


def metropolis_hastings(adjacency: Adjacency) -> np.ndarray:
    """The symmetric, doubly stochastic mixing matrix of an undirected graph (float64)."""
    n = len(adjacency)
    for i, nbrs in enumerate(adjacency):
        if i in nbrs or any(not 0 <= j < n or i not in adjacency[j] for j in nbrs):
            raise ValueError(f"rank {i}'s neighbours {sorted(nbrs)} are not an undirected "
                             f"graph on {n} ranks without self-loops")
    degree = [len(s) for s in adjacency]
    w = np.zeros((n, n), dtype=np.float64)
    for i, nbrs in enumerate(adjacency):
        for j in nbrs:
            w[i, j] = 1.0 / (1.0 + max(degree[i], degree[j]))
        w[i, i] = 1.0 - w[i].sum()
    return w
