"""Properties of simulations.partitioners.partition."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from simulations.partitioners import partition, partitioner_names

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Balanced 10-class labels like digits, without loading scikit-learn.
DIGITS_LIKE = np.repeat(np.arange(10), 150)


def check_partition(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64 and p.ndim == 1
        assert np.all(np.diff(p) > 0), "each client's indices are sorted and unique"
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "no sample lost or duplicated"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "union is exactly all indices"


def label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    ents = []
    for p in parts:
        c = np.bincount(labels[p]).astype(float)
        c = c[c > 0] / c.sum()
        ents.append(float(-(c * np.log(c)).sum()))
    return float(np.mean(ents))


@st.composite
def problems(draw, kinds=("iid", "dirichlet", "shards")):
    n = draw(st.integers(1, 300))
    num_classes = draw(st.integers(1, 10))
    labels = np.array(draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)))
    num_clients = draw(st.integers(1, min(n, 20)))
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**32 - 1))
    alpha = draw(st.sampled_from([0.05, 0.5, 1.0, 10.0]))
    spc = draw(st.integers(1, 4))
    if kind == "shards":
        assume(num_clients * spc <= n)
    return labels, num_clients, kind, seed, alpha, spc


@SETTINGS
@given(problems())
def test_disjoint_complete_deterministic(problem):
    labels, num_clients, kind, seed, alpha, spc = problem
    kwargs = dict(kind=kind, seed=seed, alpha=alpha, shards_per_client=spc)
    try:
        parts = partition(labels, num_clients, **kwargs)
    except ValueError as exc:
        # Only a Dirichlet draw can legitimately fail (no client may be empty).
        assert kind == "dirichlet" and "raise alpha" in str(exc)
        return
    check_partition(parts, len(labels), num_clients)
    assert min(len(p) for p in parts) >= 1  # default min_size=1
    again = partition(labels, num_clients, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@SETTINGS
@given(
    n=st.integers(1, 400),
    num_clients=st.integers(1, 40),
    min_size=st.integers(0, 10),
    alpha=st.sampled_from([0.1, 1.0, 100.0]),
    seed=st.integers(0, 1000),
)
def test_dirichlet_min_size_honoured(n, num_clients, min_size, alpha, seed):
    assume(num_clients * max(min_size, 1) <= n)
    labels = np.arange(n) % 7
    try:
        parts = partition(
            labels, num_clients, kind="dirichlet", alpha=alpha, seed=seed, min_size=min_size
        )
    except ValueError as exc:
        assert "raise alpha or lower min_size" in str(exc)
        return
    check_partition(parts, n, num_clients)
    assert min(len(p) for p in parts) >= min_size


@SETTINGS
@given(
    n=st.integers(50, 500),
    num_clients=st.integers(2, 10),
    kind=st.sampled_from(["iid", "dirichlet"]),
    seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2, unique=True),
)
def test_different_seeds_differ(n, num_clients, kind, seeds):
    labels = np.arange(n) % 5
    a = partition(labels, num_clients, kind=kind, seed=seeds[0], alpha=1.0, min_size=0)
    b = partition(labels, num_clients, kind=kind, seed=seeds[1], alpha=1.0, min_size=0)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_seeds_give_distinct_partitions(kind):
    results = [partition(DIGITS_LIKE, 10, kind=kind, seed=s) for s in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert any(
                not np.array_equal(x, y) for x, y in zip(results[i], results[j], strict=True)
            )


@SETTINGS
@given(n=st.integers(1, 1000), num_clients=st.integers(1, 50), seed=st.integers(0, 99))
def test_iid_sizes_near_equal(n, num_clients, seed):
    assume(num_clients <= n)
    parts = partition(np.zeros(n, dtype=int), num_clients, kind="iid", seed=seed)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_label_mix_close_to_global():
    parts = partition(DIGITS_LIKE, 10, kind="iid", seed=3)
    assert label_entropy(DIGITS_LIKE, parts) > 0.95 * math.log(10)


def test_dirichlet_small_alpha_more_skewed_than_large():
    for seed in range(5):
        skewed = partition(DIGITS_LIKE, 10, kind="dirichlet", alpha=0.05, seed=seed)
        mild = partition(DIGITS_LIKE, 10, kind="dirichlet", alpha=1.0, seed=seed)
        flat = partition(DIGITS_LIKE, 10, kind="dirichlet", alpha=1000.0, seed=seed)
        e_skewed, e_mild, e_flat = (label_entropy(DIGITS_LIKE, p) for p in (skewed, mild, flat))
        assert e_skewed < e_mild < e_flat
        assert e_skewed < 0.5 * math.log(10)
        assert e_flat > 0.98 * math.log(10)


def test_dirichlet_handles_arbitrary_label_values():
    labels = np.array([7, 7, 3, 3, 3, -1, -1, 100] * 10)
    parts = partition(labels, 4, kind="dirichlet", alpha=0.5, seed=0)
    check_partition(parts, len(labels), 4)


def test_dirichlet_gives_up_with_clear_error():
    labels = np.arange(20) % 2
    with pytest.raises(ValueError, match=r"alpha=0\.001.*works for \d+ clients.*"
                                         r"raise alpha or lower min_size"):
        partition(labels, 10, kind="dirichlet", alpha=0.001, min_size=2, seed=0)


def test_shards_balanced_labels_at_most_spc_labels():
    # 20 samples per class, 10 clients x 2 shards -> shards of 10 never straddle two labels.
    labels = np.repeat(np.arange(10), 20)
    for spc in (1, 2, 4):
        for seed in range(5):
            parts = partition(labels, 10, kind="shards", shards_per_client=spc, seed=seed)
            check_partition(parts, len(labels), 10)
            for p in parts:
                assert len(np.unique(labels[p])) <= spc


@SETTINGS
@given(
    class_sizes=st.lists(st.integers(1, 60), min_size=1, max_size=10),
    num_clients=st.integers(1, 20),
    spc=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_shards_structure(class_sizes, num_clients, spc, seed):
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(labels)  # the partitioner must sort by label itself
    n = len(labels)
    assume(num_clients * spc <= n)
    parts = partition(labels, num_clients, kind="shards", shards_per_client=spc, seed=seed)
    check_partition(parts, n, num_clients)
    lo, hi = n // (num_clients * spc), math.ceil(n / (num_clients * spc))
    for p in parts:
        assert spc * lo <= len(p) <= spc * hi
    # A shard is a run of consecutive labels after sorting; if no class is smaller than a
    # shard, a shard spans at most two labels, so a client sees at most 2 * spc labels.
    if min(class_sizes) >= hi:
        for p in parts:
            assert len(np.unique(labels[p])) <= 2 * spc


def test_natural_one_client_per_group():
    groups = np.array([5, 5, 2, 9, 2, 5, 9, 9, 9])
    labels = np.zeros(len(groups), dtype=int)
    parts = partition(labels, 3, kind="natural", groups=groups)
    check_partition(parts, len(groups), 3)
    for value, p in zip([2, 5, 9], parts, strict=True):
        assert np.array_equal(p, np.flatnonzero(groups == value))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            parts, partition(labels, 3, kind="natural", groups=groups, seed=7), strict=True
        )
    )


@pytest.mark.parametrize(
    ("labels", "num_clients", "kwargs", "pattern"),
    [
        (np.zeros(10), 0, {}, "num_clients must be an integer >= 1"),
        (np.zeros(10), -3, {}, "num_clients must be an integer >= 1"),
        (np.zeros(10), 2.5, {}, "num_clients must be an integer >= 1"),
        (np.zeros(10), 11, {}, "there are 10; ask for at most 10 clients"),
        (np.zeros(0), 1, {}, "ask for at most 0 clients"),
        (np.zeros(10), 2, {"alpha": 0}, "alpha must be a finite number > 0"),
        (np.zeros(10), 2, {"alpha": -1.0, "kind": "dirichlet"}, "alpha must be"),
        (np.zeros(10), 2, {"alpha": "0.5", "kind": "dirichlet"}, "alpha must be"),
        (np.zeros(10), 2, {"alpha": float("inf")}, "alpha must be"),
        (np.zeros(10), 2, {"kind": "pathological"}, "unknown partitioner 'pathological'; choose"),
        (np.zeros(10), 2, {"kind": "natural"}, "natural partition needs groups"),
        (
            np.zeros(10),
            2,
            {"kind": "natural", "groups": np.arange(10) % 3},
            "has 3 groups but 2 clients were asked for; set federation.clients = 3",
        ),
        (
            np.zeros(10),
            2,
            {"kind": "natural", "groups": np.arange(9)},
            "one entry per sample",
        ),
        (np.zeros(10), 4, {"kind": "shards", "shards_per_client": 3}, "lower shards_per_client"),
        (np.zeros(10), 2, {"kind": "shards", "shards_per_client": 0}, "shards_per_client must"),
        (np.zeros(10), 3, {"min_size": 4}, "ask for at most 2 clients or lower min_size"),
        (np.zeros(10), 2, {"min_size": -1}, "min_size must be an integer >= 0"),
        (np.zeros(10), 2, {"seed": -1}, "seed must be a non-negative integer"),
        (np.zeros((5, 2)), 2, {}, "labels must be 1-D"),
        (
            np.zeros(10),
            2,
            {"kind": "natural", "groups": np.array([0] * 9 + [1]), "min_size": 2},
            "natural partition gives a client only 1 samples",
        ),
    ],
)
def test_errors_say_what_to_change(labels, num_clients, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        partition(labels, num_clients, **kwargs)


def test_names():
    assert partitioner_names() == ["dirichlet", "iid", "natural", "shards"]


@pytest.mark.parametrize("asked", [5000, 1437])
def test_dirichlet_advice_names_a_count_that_works(asked):
    """Too many clients for Dirichlet: the advised count is one the partitioner accepts."""
    labels = np.arange(1437) % 10
    with pytest.raises(ValueError, match=r"(?:at most|works for) \d+") as info:
        partition(labels, asked, kind="dirichlet", alpha=0.5, seed=0)
    advised = int(re.search(r"(?:at most|works for) (\d+)", str(info.value)).group(1))
    assert 50 <= advised < 1437
    parts = partition(labels, advised, kind="dirichlet", alpha=0.5, seed=0)
    check_partition(parts, 1437, advised)
