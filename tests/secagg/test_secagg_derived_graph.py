"""The malicious mode's derived graph: the seed from the advertisement list, the list's
t-core (numpy peel) against a plain one-at-a-time peel, and one client's neighbours
against the whole graph's."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from privacy.secagg import malicious as mal
from privacy.secagg.graph import neighbour_array, regular_graph


def peel(neighbours: list[frozenset[int]], active: set[int], t: int) -> set[int]:
    """The t-core the plain way: drop one node with fewer than t neighbours left, repeat."""
    core = set(active)
    changed = True
    while changed:
        changed = False
        for u in sorted(core):
            if len(neighbours[u] & core) < t:
                core.discard(u)
                changed = True
    return core


@pytest.mark.parametrize(("n", "k", "t"), [(10, 3, 2), (10, 4, 3), (12, 5, 3), (30, 6, 4),
                                           (40, 8, 5), (41, 10, 6), (9, 8, 5)])
def test_the_numpy_core_equals_the_plain_peel_on_random_lists(n, k, t):
    rng = random.Random(n * 100 + k)
    for trial in range(40):
        seed = hashlib.sha256(b"core %d %d %d" % (n, k, trial)).digest()
        graph = regular_graph(n, k, seed)
        listed = {u for u in range(n) if rng.random() > rng.choice((0.05, 0.2, 0.4))}
        active = np.zeros(n, dtype=bool)
        active[list(listed)] = True
        got = mal.threshold_core(neighbour_array(n, k, seed), active, t)
        assert set(np.flatnonzero(got).tolist()) == peel(graph, listed, t), (trial, listed)
        assert np.array_equal(active, np.isin(np.arange(n), list(listed)))  # not modified


def digest_of(listed: tuple[tuple[int, bytes], ...]) -> bytes:
    return mal.list_digest(0, 1, listed)


@pytest.mark.parametrize(("n", "k", "t"), [(12, 5, 3), (30, 6, 4), (9, 8, 5)])
def test_a_clients_derived_neighbours_are_its_row_inside_the_core(n, k, t):
    ids = tuple(range(100, 100 + 3 * n, 3))  # ids are not positions
    rng = random.Random(n)
    for trial in range(12):
        missing = set() if trial == 0 else set(rng.sample(ids, rng.randint(1, n // 3)))
        listed = tuple((c, bytes([c % 256]) * 32) for c in ids if c not in missing)
        digest = digest_of(listed)
        graph = regular_graph(n, k, mal.derive_seed(digest))
        core = peel(graph, {i for i, c in enumerate(ids) if c not in missing}, t)
        for i, c in enumerate(ids):
            got = mal.derived_neighbours(ids, k, t, listed, digest, c)
            if i not in core:
                assert got is None, (trial, c)
            else:
                assert got == {ids[j] for j in graph[i] & core}, (trial, c)
        if trial == 0:
            assert core == set(range(n))  # everybody listed: everybody kept
    assert mal.derived_neighbours(ids, k, t, listed, digest, 7) is None  # not a participant


def test_the_seed_is_the_lists_and_every_graph_is_kept():
    digest = digest_of(((1, bytes(32)), (2, bytes(32))))
    seed = mal.derive_seed(digest)
    assert seed == hashlib.sha256(b"fedring-secagg/v1/graph-seed\x00" + digest +
                                  bytes(4)).digest()
    assert mal.derive_seed(digest_of(((1, bytes(32)),))) != seed
