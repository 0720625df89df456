"""The public communication graph: a random k-regular graph from the round seed.

Every party derives the same graph from the same 32-byte seed: the randomness is
an AES-128-CTR keystream (not Python's or numpy's generators, whose algorithms may
change between versions), and the construction below is deterministic given it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from functools import lru_cache

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_MAX_SWITCH_TRIES = 1000
_MAX_ATTEMPTS = 100


class SeededStream:
    """Deterministic uniform words from a seed (AES-128-CTR keystream)."""

    def __init__(self, seed: bytes, label: bytes) -> None:
        key = hashlib.sha256(b"fedring-secagg/stream/" + label + b"/" + seed).digest()[:16]
        self._enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        self._pool: list[int] = []

    def uint64(self, count: int) -> np.ndarray:
        return np.frombuffer(self._enc.update(bytes(8 * count)), dtype="<u8")

    def below(self, bound: int) -> int:
        """A uniform-enough integer in [0, bound) (multiply-shift, bias < bound / 2^64)."""
        if not self._pool:
            self._pool = self.uint64(256).tolist()
        return (self._pool.pop() * bound) >> 64

    def permutation(self, count: int) -> np.ndarray:
        """A uniform permutation of range(count) (sort by random 64-bit keys)."""
        return np.argsort(self.uint64(count), kind="stable")


def regular_graph(n: int, k: int, seed: bytes) -> list[frozenset[int]]:
    """Neighbour sets of a random k-regular simple graph on nodes 0..n-1 (see below).

    Memoized per (n, k, seed): the graph is public and deterministic, and a client
    rebuilt from its saved state derives it again for every message of a round.
    """
    return list(_regular_graph(n, k, bytes(seed)))


@lru_cache(maxsize=16)
def _regular_graph(n: int, k: int, seed: bytes) -> tuple[frozenset[int], ...]:
    """Neighbour sets of a random k-regular simple graph on nodes 0..n-1.

    k = n-1 gives the complete graph (full SecAgg). For k > (n-1)/2 the sparser
    complement is built and inverted. The sparse graph comes from the pairing
    (configuration) model: shuffle all n*k half-edges and pair them up; pairs that
    would make a loop or a double edge are repaired by edge switches with random
    existing edges (u-v bad, x-y random: drop x-y, add u-x and v-y), which keeps
    every degree at k. The rare dead end restarts from further along the stream.
    """
    if n < 2 or not 1 <= k <= n - 1:
        raise ValueError(f"need n >= 2 and 1 <= k <= n-1, got n={n}, k={k}")
    if (n * k) % 2:
        raise ValueError(f"no {k}-regular graph on {n} nodes: n*k is odd")
    complement = k > (n - 1) // 2
    degree = n - 1 - k if complement else k
    if degree == 0:
        adj: list[set[int]] = [set() for _ in range(n)]
    else:
        stream = SeededStream(seed, b"graph")
        for _ in range(_MAX_ATTEMPTS):
            edges = _try_pairing(n, degree, stream)
            if edges is not None:
                break
        else:  # pragma: no cover - astronomically unlikely
            raise RuntimeError(f"could not build a {degree}-regular graph on {n} nodes")
        adj = _adjacency(n, edges)
    if complement:
        everyone = set(range(n))
        return tuple(frozenset(everyone - adj[u] - {u}) for u in range(n))
    return tuple(frozenset(s) for s in adj)


def _adjacency(n: int, edges: np.ndarray) -> list[set[int]]:
    """Neighbour sets from edge codes a*n+b."""
    a, b = edges // n, edges % n
    src = np.concatenate([a, b])
    dst = np.concatenate([b, a])
    order = np.argsort(src, kind="stable")
    bounds = np.searchsorted(src[order], np.arange(n + 1))
    dst = dst[order].tolist()
    return [set(dst[bounds[u] : bounds[u + 1]]) for u in range(n)]


def _try_pairing(n: int, k: int, stream: SeededStream) -> np.ndarray | None:
    """Edge codes a*n+b (a<b) of a k-regular graph, or None if the repair got stuck."""
    stubs = np.repeat(np.arange(n, dtype=np.int64), k)
    pairs = stubs[stream.permutation(stubs.size)].reshape(-1, 2)
    a, b = pairs.min(axis=1), pairs.max(axis=1)
    codes = a * n + b
    ok = a != b
    ok[ok] &= _first_occurrences(codes[ok])
    edges = codes[ok].tolist()
    index = {e: i for i, e in enumerate(edges)}
    left = pairs[~ok].ravel().tolist()

    def add(u: int, v: int) -> None:
        e = min(u, v) * n + max(u, v)
        index[e] = len(edges)
        edges.append(e)

    def remove(e: int) -> None:
        i = index.pop(e)
        last = edges.pop()
        if last != e:
            edges[i] = last
            index[last] = i

    while left:
        v, u = left.pop(), left.pop()
        if u != v and min(u, v) * n + max(u, v) not in index:
            add(u, v)
            continue
        # edge switch: trade a random edge (x, y) for (u, x) and (v, y)
        for _ in range(_MAX_SWITCH_TRIES):
            x, y = divmod(edges[stream.below(len(edges))], n)
            if stream.below(2):
                x, y = y, x
            if x in (u, v) or y in (u, v):
                continue
            if min(u, x) * n + max(u, x) in index or min(v, y) * n + max(v, y) in index:
                continue
            remove(min(x, y) * n + max(x, y))
            add(u, x)
            add(v, y)
            break
        else:
            return None
    return np.array(edges, dtype=np.int64)


def _first_occurrences(codes: np.ndarray) -> np.ndarray:
    first = np.zeros(codes.size, dtype=bool)
    first[np.unique(codes, return_index=True)[1]] = True
    return first


def graph_connected(n: int, k: int, seed: bytes) -> bool:
    """Whether the public k-regular graph on n nodes from ``seed`` is connected."""
    if 2 * k >= n - 1:  # any two nodes are adjacent or share a neighbour
        return True
    return _connected(n, k, bytes(seed))


@lru_cache(maxsize=16)
def _connected(n: int, k: int, seed: bytes) -> bool:
    return len(component_of(0, regular_graph(n, k, seed))) == n


def component_of(start: int, adjacency: Mapping[int, Iterable[int]] | list) -> set[int]:
    """The nodes reachable from ``start`` (``adjacency[u]``: the neighbours of u)."""
    seen, todo = {start}, [start]
    while todo:
        for v in adjacency[todo.pop()]:
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return seen
