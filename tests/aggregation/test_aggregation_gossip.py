"""Gossip topologies and Metropolis–Hastings mixing weights (``aggregation.gossip``)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from aggregation.gossip import metropolis_hastings, random_topology, ring_topology, topology


def test_metropolis_hastings_weights_of_a_path_by_hand() -> None:
    # 0 - 1 - 2 - 3 plus 1 - 3: degrees 1, 3, 2, 2.
    adjacency = [frozenset({1}), frozenset({0, 2, 3}), frozenset({1, 3}), frozenset({1, 2})]
    w = metropolis_hastings(adjacency)
    # W_ij = 1 / (1 + max(d_i, d_j)) on an edge; W_ii = 1 - the row's other entries.
    expected = np.array([
        [3 / 4, 1 / 4, 0, 0],
        [1 / 4, 1 - 3 / 4, 1 / 4, 1 / 4],
        [0, 1 / 4, 1 - 1 / 4 - 1 / 3, 1 / 3],
        [0, 1 / 4, 1 / 3, 1 - 1 / 4 - 1 / 3],
    ])
    np.testing.assert_allclose(w, expected, rtol=0, atol=1e-15)


def test_a_ring_of_three_averages_uniformly_and_a_ring_of_two_halves() -> None:
    np.testing.assert_allclose(metropolis_hastings(ring_topology(3)), np.full((3, 3), 1 / 3))
    np.testing.assert_allclose(metropolis_hastings(ring_topology(2)), np.full((2, 2), 1 / 2))
    assert ring_topology(5)[0] == {4, 1} and ring_topology(5)[4] == {3, 0}


def _connected(adjacency: list[frozenset[int]]) -> bool:
    seen, todo = {0}, deque([0])
    while todo:
        for j in adjacency[todo.popleft()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return len(seen) == len(adjacency)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 20])
@pytest.mark.parametrize("kind", ["ring", "random"])
def test_every_topology_is_connected_and_its_weights_are_doubly_stochastic(n: int,
                                                                           kind: str) -> None:
    for seed in range(5):
        adjacency = topology(kind, n, degree=3, seed=[seed, 7])
        assert _connected(adjacency)
        assert all(i not in a and all(i in adjacency[j] for j in a)
                   for i, a in enumerate(adjacency))
        w = metropolis_hastings(adjacency)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        np.testing.assert_array_equal(w, w.T)
        assert (w >= 0).all()
        assert ((w > 0) == (np.eye(n, dtype=bool) | np.array(
            [[j in adjacency[i] for j in range(n)] for i in range(n)]))).all()


def test_the_random_topology_is_seeded_and_bounded_by_its_degree() -> None:
    a = random_topology(20, 4, [0, 3])
    assert a == random_topology(20, 4, [0, 3])
    assert a != random_topology(20, 4, [0, 4])  # another round, another graph
    degrees = [len(s) for s in a]
    assert min(degrees) >= 2 and max(degrees) == 4 and sum(degrees) >= 20 * 4 - 4
    assert random_topology(5, 4, 0) == [frozenset(set(range(5)) - {r}) for r in range(5)]


def test_a_graph_that_is_not_undirected_is_refused() -> None:
    with pytest.raises(ValueError, match="not an undirected graph"):
        metropolis_hastings([frozenset({1}), frozenset()])
    with pytest.raises(ValueError, match="degree >= 2"):
        random_topology(5, 1, 0)
