"""Default degree and threshold, configuration checks, the seeded regular graph."""

from __future__ import annotations

import math
import os

import pytest

from privacy.secagg import SessionParams, default_k, default_threshold
from privacy.secagg.graph import regular_graph
from privacy.secagg.params import binomial_tail_at_least, binomial_tail_below


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


@pytest.mark.parametrize(
    ("n", "k"), [(2, 1), (3, 2), (4, 1), (10, 3), (10, 4), (11, 6), (50, 31), (100, 99), (300, 20)]
)
def test_regular_graph_is_simple_regular_and_seeded(n, k):
    seed = os.urandom(32)
    g = regular_graph(n, k, seed)
    assert len(g) == n
    for u, nbrs in enumerate(g):
        assert len(nbrs) == k and u not in nbrs and all(u in g[v] for v in nbrs)
    assert regular_graph(n, k, seed) == g  # every party derives the same graph
    if 1 < k < n - 2:
        assert any(regular_graph(n, k, os.urandom(32)) != g for _ in range(3))


def test_regular_graph_refuses_impossible_degrees():
    for n, k in ((3, 1), (4, 4), (1, 0), (5, 0)):
        with pytest.raises(ValueError):
            regular_graph(n, k, bytes(32))
