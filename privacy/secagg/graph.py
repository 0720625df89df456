"""The public communication graph: a Harary graph over a permutation drawn from a seed.

Positions 0..n-1 on a ring hold a uniform permutation of the nodes 0..n-1, drawn from
the round's 32-byte seed (an AES-128-CTR keystream, not Python's or numpy's
generators, whose algorithms may change between versions). The node at position p is
adjacent to the positions p +- 1 .. p +- h (mod n), h = floor(k/2), and, when k is odd
(n is then even, since n*k is), to p + n/2: Harary's graph H(k, n), k-regular and
k-connected (Harary 1962; removing fewer than k nodes never disconnects it). k = n-1
gives the complete graph (full SecAgg).

Every party derives the same graph from the same seed. A client needs only its own
row, :func:`node_neighbours`: the permutation (O(n) keystream plus a numpy argsort) and
k offsets, memoized per (n, seed); the server and tests take the whole graph
(:func:`neighbour_array`, :func:`regular_graph`). Since the node at a given position is
uniform and the others fill the remaining positions uniformly, a node's neighbours are
a uniform k-subset of the other n-1 (what the choice of k in
:mod:`privacy.secagg.params` relies on). The permutation sorts 64-bit keys, ties (if
any) by index: it is uniform up to statistical distance C(n, 2) / 2^64 (2^-45 at
n = 1000).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from functools import lru_cache

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


class SeededStream:
    """Deterministic uniform words from a seed (AES-128-CTR keystream)."""

    def __init__(self, seed: bytes, label: bytes) -> None:
        key = hashlib.sha256(b"fedring-secagg/stream/" + label + b"/" + seed).digest()[:16]
        self._enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def uint64(self, count: int) -> np.ndarray:
        return np.frombuffer(self._enc.update(bytes(8 * count)), dtype="<u8")

    def permutation(self, count: int) -> np.ndarray:
        """A uniform permutation of range(count) (sort by random 64-bit keys)."""
        return np.argsort(self.uint64(count), kind="stable")


def _check(n: int, k: int) -> None:
    if n < 2 or not 1 <= k <= n - 1:
        raise ValueError(f"need n >= 2 and 1 <= k <= n-1, got n={n}, k={k}")
    if (n * k) % 2:
        raise ValueError(f"no {k}-regular graph on {n} nodes: n*k is odd")


def offsets(n: int, k: int) -> np.ndarray:
    """The k position offsets of a node's neighbours: +-1 .. +-floor(k/2), and n/2 when k
    is odd (all distinct and nonzero mod n for 1 <= k <= n-1 with n*k even)."""
    _check(n, k)
    h = k // 2
    steps = np.arange(1, h + 1, dtype=np.int64)
    parts = [steps, n - steps] + ([np.array([n // 2], dtype=np.int64)] if k % 2 else [])
    return np.concatenate(parts)


@lru_cache(maxsize=16)
def _placement(n: int, seed: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(order, place): the node at each position and each node's position (read-only)."""
    order = SeededStream(seed, b"graph-order").permutation(n)
    place = np.empty(n, dtype=np.int64)
    place[order] = np.arange(n, dtype=np.int64)
    order.setflags(write=False)
    place.setflags(write=False)
    return order, place


def node_neighbours(n: int, k: int, seed: bytes, node: int) -> np.ndarray:
    """The neighbours of ``node`` (sorted node indices): the permutation (a keystream of n
    words and their numpy argsort), memoized per (n, seed), then O(k) for the row."""
    _check(n, k)
    if not 0 <= node < n:
        raise ValueError(f"node {node} is not in 0..{n - 1}")
    if k == n - 1:  # the complete graph: no permutation needed
        return np.delete(np.arange(n, dtype=np.int64), node)
    order, place = _placement(n, bytes(seed))
    return np.sort(order[(place[node] + offsets(n, k)) % n])


def neighbour_array(n: int, k: int, seed: bytes) -> np.ndarray:
    """The whole graph as an (n, k) array: row u holds u's neighbours, sorted."""
    _check(n, k)
    if k == n - 1:
        full = np.broadcast_to(np.arange(n, dtype=np.int64), (n, n))
        return full[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    order, place = _placement(n, bytes(seed))
    return np.sort(order[(place[:, None] + offsets(n, k)[None, :]) % n], axis=1)


def regular_graph(n: int, k: int, seed: bytes) -> list[frozenset[int]]:
    """Neighbour sets of the k-regular graph on nodes 0..n-1 from ``seed`` (all rows of
    :func:`neighbour_array`)."""
    return [frozenset(row) for row in neighbour_array(n, k, seed).tolist()]


def graph_connected(n: int, k: int, seed: bytes) -> bool:
    """Whether the graph on n nodes from ``seed`` is connected: always for k >= 2
    (k-connected); for k = 1 (a perfect matching) only when n = 2. ``seed`` is unused."""
    del seed
    _check(n, k)
    return k >= 2 or n == 2


def component_of(start: int, adjacency: Mapping[int, Iterable[int]] | list) -> set[int]:
    """The nodes reachable from ``start`` (``adjacency[u]``: the neighbours of u)."""
    seen, todo = {start}, [start]
    while todo:
        for v in adjacency[todo.pop()]:
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return seen
