"""Simulated client heterogeneity: speed and availability profiles under a seed.

Node ids are ranked (sorted) and profile ``i`` goes to the ``i``-th node, so the same
seed and node set give the same profiles on every engine. Everything is drawn from
numpy generators seeded by (run seed, purpose, node rank): no global state. A ``range``
of node ids (the in-process engine's) is ranked without listing it: a few bytes a node.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from server.clock import SimulatedClock
from server.driver_config import ClientsConfig

_SPEED, _STRAGGLERS, _OFFLINE, _SCHEDULE = 1, 2, 3, 4


class RangeRank(Mapping[int, int]):
    """The ranks of an ascending ``range`` of node ids: ``node -> node - start``."""

    def __init__(self, nodes: range) -> None:
        self.nodes = nodes

    def __getitem__(self, node: int) -> int:
        if node not in self.nodes:
            raise KeyError(node)
        return (node - self.nodes.start) // self.nodes.step

    def __iter__(self) -> Iterator[int]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


class ClientProfiles:
    """Per-client compute time and online/offline schedule (a ``server.clock.ClientModel``)."""

    def __init__(self, cfg: ClientsConfig, seed: int) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        self._rank: Mapping[int, int] = {}
        self._all_online = True
        self.speed = np.zeros(0)
        self.straggler = np.zeros(0, dtype=bool)
        self.flaky = np.zeros(0, dtype=bool)
        self._switches: dict[int, list[float]] = {}  # flaky node -> times its state flips
        self._first_online: dict[int, bool] = {}
        self._rngs: dict[int, np.random.Generator] = {}

    def bind(self, nodes: Iterable[int]) -> None:
        """Draw the profiles for this node set (again only if the set changed)."""
        if isinstance(nodes, range) and nodes.step > 0:
            if isinstance(self._rank, RangeRank) and self._rank.nodes == nodes:
                return
            rank: Mapping[int, int] = RangeRank(nodes)
        else:
            ordered = sorted(int(n) for n in nodes)
            if ordered == sorted(self._rank):
                return
            rank = {node: i for i, node in enumerate(ordered)}
        n, cfg = len(rank), self.cfg
        self._rank = rank
        factor = (np.random.default_rng([self.seed, _SPEED]).lognormal(0.0, cfg.speed_sigma, n)
                  if cfg.speed_sigma > 0 else np.ones(n))
        self.straggler = self._pick(cfg.straggler_fraction, n, _STRAGGLERS)
        self.speed = cfg.compute_s * factor * np.where(self.straggler,
                                                       cfg.straggler_slowdown, 1.0)
        self.flaky = self._pick(cfg.offline_fraction, n, _OFFLINE)
        self._all_online = not self.flaky.any()
        self._switches.clear()
        self._first_online.clear()
        self._rngs.clear()

    def _pick(self, fraction: float, n: int, purpose: int) -> np.ndarray:
        chosen = np.zeros(n, dtype=bool)
        count = round(fraction * n)
        if count:
            chosen[np.random.default_rng([self.seed, purpose]).permutation(n)[:count]] = True
        return chosen

    def _index(self, node: int) -> int:
        try:
            return self._rank[int(node)]
        except KeyError:
            raise LookupError(f"node {node} has no profile; bind() the node set first") from None

    def always_online(self) -> bool:
        """Whether no bound node ever goes offline (no node is offline-prone)."""
        return self._all_online

    def duration(self, node: int, start: float) -> float:
        return float(self.speed[self._index(node)])

    # ---- availability: alternating exponential online/offline periods for flaky nodes

    def _flips(self, node: int, until: float) -> tuple[bool, list[float]]:
        """Whether the node starts online, and its state flips up to at least ``until``."""
        i = self._index(node)
        if i not in self._rngs:
            rng = np.random.default_rng([self.seed, _SCHEDULE, i])
            on, off = self.cfg.online_s, self.cfg.offline_s
            self._rngs[i] = rng
            self._first_online[i] = bool(rng.random() < on / (on + off))
            self._switches[i] = [0.0]
        rng, flips = self._rngs[i], self._switches[i]
        while flips[-1] <= until:
            online_now = self._first_online[i] == (len(flips) % 2 == 1)
            mean = self.cfg.online_s if online_now else self.cfg.offline_s
            flips.append(flips[-1] + float(rng.exponential(mean)))
        return self._first_online[i], flips

    def online(self, node: int, t: float) -> bool:
        if not self.flaky[self._index(node)]:
            return True
        first, flips = self._flips(node, t)
        period = bisect.bisect_right(flips, t) - 1  # flips[period] <= t < flips[period + 1]
        return first == (period % 2 == 0)

    def offline_between(self, node: int, start: float, end: float) -> float | None:
        if not self.flaky[self._index(node)]:
            return None
        if not self.online(node, start):
            return start
        _, flips = self._flips(node, end)
        nxt = flips[bisect.bisect_right(flips, start)]  # the end of the current online period
        return nxt if nxt < end else None

    def next_online(self, node: int, t: float) -> float:
        if self.online(node, t):
            return t
        _, flips = self._flips(node, t)
        return flips[bisect.bisect_right(flips, t)]

    def describe(self) -> dict[str, Any]:
        """The drawn profiles, for logs and benchmarks."""
        nodes = sorted(self._rank, key=self._rank.__getitem__)
        return {"stragglers": [n for n in nodes if self.straggler[self._rank[n]]],
                "offline_prone": [n for n in nodes if self.flaky[self._rank[n]]],
                "compute_s": {str(n): round(float(self.speed[self._rank[n]]), 6)
                              for n in nodes}}


def make_clock(config: Mapping[str, Any]) -> SimulatedClock:
    """A simulated clock for a resolved scenario (its ``[clients]`` section and seed)."""
    cfg = ClientsConfig(**config.get("clients", {}))
    return SimulatedClock(ClientProfiles(cfg, int(config.get("seed", 0))))

