"""Default degree and threshold, configuration checks, the seeded regular graph."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from privacy.secagg import SessionParams, default_k, default_threshold, graph
from privacy.secagg.graph import SeededStream, neighbour_array, node_neighbours, regular_graph
from privacy.secagg.params import (
    binomial_tail_at_least,
    binomial_tail_below,
    disconnection_bound,
)


@pytest.mark.parametrize("k", [1, 2, 3, 10, 31, 99])
def test_default_threshold_is_a_strict_majority(k):
    t = default_threshold(k)
    assert 2 * t > k and t <= k and (t == 1 or 2 * (t - 1) <= k)


@pytest.mark.parametrize("n", [50, 100, 1000, 10**5, 10**6])
@pytest.mark.parametrize(("delta", "gamma"), [(0.1, 0.0), (0.2, 0.05), (0.05, 0.1)])
def test_default_k_meets_its_documented_bounds_and_is_minimal(n, delta, gamma):
    k = default_k(n, dropout_fraction=delta, corrupt_fraction=gamma)
    assert 1 <= k <= n - 1 and (n * k) % 2 == 0
    if k == n - 1:
        return
    t = default_threshold(k)
    assert n * binomial_tail_below(k, 1 - delta, t) <= 2**-20
    assert n * binomial_tail_at_least(k, gamma, t) <= 2**-40
    smaller = k - 2 if n % 2 else k - 1  # the previous admissible degree fails a bound
    if smaller >= 1:
        ts = default_threshold(smaller)
        fails = n * binomial_tail_below(smaller, 1 - delta, ts) > 2**-20
        leaks = n * binomial_tail_at_least(smaller, gamma, ts) > 2**-40
        assert fails or leaks


def test_default_k_grows_logarithmically_and_is_full_for_small_n():
    ks = {n: default_k(n) for n in (10, 10**3, 10**4, 10**5, 10**6)}
    assert ks[10] == 9  # full SecAgg
    for a, b in ((10**3, 10**4), (10**4, 10**5), (10**5, 10**6)):
        assert ks[a] <= ks[b] <= ks[a] + 8  # +O(1) per factor 10 of n
    assert ks[10**6] < 4 * math.log2(10**6)


def test_binomial_tail_is_exact():
    assert binomial_tail_below(3, 0.5, 2) == pytest.approx(0.5)
    assert binomial_tail_below(4, 0.9, 0) == 0
    assert binomial_tail_below(4, 0.9, 5) == pytest.approx(1.0)
    assert binomial_tail_at_least(3, 0.5, 2) == pytest.approx(0.5)
    assert binomial_tail_at_least(10, 0.1, 0) == pytest.approx(1.0)
    exact = sum(math.comb(60, i) * 0.05**i * 0.95 ** (60 - i) for i in range(31, 61))
    assert binomial_tail_at_least(60, 0.05, 31) == pytest.approx(exact, rel=1e-9)
    assert 0 < exact < 1e-20  # 1 - P[below] would round this to 0 or 1e-16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"participants": (1,)},
        {"participants": (2, 1)},
        {"participants": (1, 1, 2)},
        {"k": 0},
        {"k": 4},
        {"t": 0},
        {"t": 3, "k": 2},
        {"bits": 0},
        {"bits": 65},
        {"dim": 0},
        {"seed": b"short"},
        {"participants": (1, 2, 3), "k": 1},  # n*k odd
    ],
)
def test_config_validation(kwargs):
    base = dict(participants=(1, 2, 3, 4), k=2, t=1, bits=32, dim=10, run_id=0, round_id=0)
    base["seed"] = bytes(32)
    base.update(kwargs)
    with pytest.raises(ValueError):
        SessionParams(**base)


def test_config_create_fills_defaults():
    cfg = SessionParams.create(range(100, 0, -1), 7)
    assert cfg.participants == tuple(range(1, 101))
    assert (cfg.k, cfg.t) == (default_k(100), default_threshold(default_k(100)))
    assert cfg.positions[1] == 0 and len(cfg.seed) == 32


GRAPHS = [(2, 1), (3, 2), (4, 1), (4, 3), (10, 3), (10, 4), (11, 6), (12, 5), (50, 31),
          (100, 99), (300, 20)]


@pytest.mark.parametrize(("n", "k"), GRAPHS)
def test_regular_graph_is_simple_regular_and_seeded(n, k):
    seed = os.urandom(32)
    g = regular_graph(n, k, seed)
    assert len(g) == n
    for u, nbrs in enumerate(g):
        assert len(nbrs) == k and u not in nbrs and all(u in g[v] for v in nbrs)
    assert regular_graph(n, k, seed) == g  # every party derives the same graph
    if 1 < k < n - 2:
        assert any(regular_graph(n, k, os.urandom(32)) != g for _ in range(3))


@pytest.mark.parametrize(("n", "k"), GRAPHS)
def test_one_nodes_neighbours_are_its_row_of_the_whole_graph(n, k):
    seed = os.urandom(32)
    whole = neighbour_array(n, k, seed)
    assert whole.shape == (n, k)
    for u in range(n):
        assert node_neighbours(n, k, seed, u).tolist() == whole[u].tolist()
        assert set(whole[u].tolist()) == regular_graph(n, k, seed)[u]


def test_the_graph_is_a_harary_graph_over_the_seeds_permutation():
    n, k, seed = 12, 5, os.urandom(32)  # odd k: the ring +-1, +-2 and the diameter
    order = SeededStream(seed, b"graph-order").permutation(n).tolist()
    g = regular_graph(n, k, seed)
    for p, u in enumerate(order):
        assert g[u] == {order[(p + o) % n] for o in (1, 2, -1, -2, 6)}


@pytest.mark.parametrize(("n", "k"), [(5, 2), (6, 3), (7, 4), (8, 3), (9, 4), (10, 5),
                                      (11, 6), (12, 3)])
def test_the_graph_is_k_connected(n, k):
    """Removing any k-1 nodes leaves it connected (checked with scipy's csgraph); some k
    nodes disconnect it (its connectivity is exactly k)."""
    g = regular_graph(n, k, os.urandom(32))
    split = False
    for size in (k - 1, k):
        for gone in itertools.combinations(range(n), size):
            keep = [u for u in range(n) if u not in gone]
            index = {u: i for i, u in enumerate(keep)}
            edges = [(index[u], index[v]) for u in keep for v in g[u] if v in index]
            rows, cols = zip(*edges, strict=True) if edges else ((), ())
            adjacency = csr_matrix((np.ones(len(edges)), (rows, cols)), shape=(len(keep),) * 2)
            parts = connected_components(adjacency, directed=False)[0]
            if size == k - 1:
                assert parts == 1, gone
            split |= parts > 1
    assert split


@pytest.mark.parametrize(("n", "k"), [(20, 4), (21, 6), (20, 7)])
def test_a_nodes_neighbours_are_a_uniform_subset_of_the_others(n, k):
    """Over many seeds each other node is a neighbour of node 0 with frequency k/(n-1). A
    fixed ring would give 1 to k of them and 0 to the rest; a position-bound rule (node
    0's neighbours always near node 0 in the ring of ids) fails the tolerance."""
    draws = 4000
    counts = np.zeros(n, dtype=np.int64)
    for i in range(draws):
        counts[node_neighbours(n, k, i.to_bytes(32, "little"), 0)] += 1
    assert counts[0] == 0 and counts.sum() == draws * k
    p = k / (n - 1)
    tolerance = 5 * math.sqrt(draws * p * (1 - p))  # 5 standard deviations
    assert np.all(np.abs(counts[1:] - draws * p) <= tolerance), counts


def test_the_permutation_is_memoized_per_n_and_seed():
    graph._placement.cache_clear()
    seed = os.urandom(32)
    for u in range(10):
        node_neighbours(10, 4, seed, u)
    assert graph._placement.cache_info().misses == 1
    node_neighbours(10, 9, seed, 0)  # the full graph needs no permutation
    assert graph._placement.cache_info().misses == 1


def test_the_connectivity_bound_and_default_k():
    # the honest survivors' graph splits only when two disjoint runs of h positions go
    assert disconnection_bound(100, 99, 0.1, 0.05) == 0.0  # the full graph
    assert disconnection_bound(100, 34, 0.1, 0.05) == pytest.approx(4950 * 0.15**34)
    assert disconnection_bound(100, 35, 0.1, 0.05) == pytest.approx(4950 * 0.15**34)
    assert disconnection_bound(100, 1, 0.1, 0.05) == 4950  # a matching: never connected
    # the defaults never need it (1-2 ask more) ...
    for n in (3, 10, 33, 34, 100, 1000, 10_000):
        assert disconnection_bound(n, default_k(n), 0.1, 0.05) <= 2**-75
    # ... but with few dropouts and no corrupt clients assumed it binds: 1-2 alone would
    # take k = 11 here, whose 2h = 10 positions leave the bound near 2^-31
    fractions = {"dropout_fraction": 0.05, "corrupt_fraction": 0.0}
    k = default_k(100, threshold_fraction=0.3, **fractions)
    assert k == 14
    assert disconnection_bound(100, k, 0.05, 0.0) <= 2**-40
    assert disconnection_bound(100, k - 1, 0.05, 0.0) > 2**-40
    assert 100 * binomial_tail_below(11, 0.95, default_threshold(11, 0.3)) <= 2**-20
    assert default_k(100, dropout_fraction=0.0, corrupt_fraction=0.0) == 2  # not a matching


def test_regular_graph_refuses_impossible_degrees():
    for n, k in ((3, 1), (4, 4), (1, 0), (5, 0)):
        with pytest.raises(ValueError):
            regular_graph(n, k, bytes(32))
        with pytest.raises(ValueError):
            node_neighbours(n, k, bytes(32), 0)
    with pytest.raises(ValueError):
        node_neighbours(4, 3, bytes(32), 4)
