"""The clock a round driver runs on: wall-clock time, or simulated time from client profiles.

On the wall clock a reply arrives when the Grid delivers it and the driver cannot know
when a client will answer or whether it is online. On a simulated clock, a
:class:`ClientModel` (e.g. ``simulations.heterogeneity.ClientProfiles``) says how long
each client's task takes and when clients are online, so a run with stragglers and
dropouts takes simulated, not real, seconds and is reproducible under a seed; the
replies themselves are still computed by the Grid (lazily, when pulled).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class ClientModel(Protocol):
    """Per-client speed and availability, on simulated seconds."""

    def bind(self, nodes: Iterable[int]) -> None:
        """Assign profiles to the federation's node ids (deterministic for the set)."""
        ...

    def duration(self, node: int, start: float) -> float:
        """Seconds ``node`` needs for one task started at ``start``."""
        ...

    def online(self, node: int, t: float) -> bool:
        """Whether ``node`` is online at time ``t``."""
        ...

    def offline_between(self, node: int, start: float, end: float) -> float | None:
        """The first time in ``[start, end)`` at which ``node`` goes offline, else None."""
        ...

    def next_online(self, node: int, t: float) -> float:
        """The first time ``>= t`` at which ``node`` is online."""
        ...


@dataclass(frozen=True)
class Outcome:
    """How a task started at ``start`` ends on the simulated clock.

    ``end`` is when the reply arrives, or when the client goes offline (``lost``).
    """

    start: float
    end: float
    lost: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start


class Clock:
    """The clock interface; this base runs on wall-clock time (see :class:`WallClock`)."""

    simulated = False

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self._t0

    def bind(self, nodes: Iterable[int]) -> None:
        """Nothing to bind on the wall clock."""

    def advance_to(self, t: float) -> None:
        """The wall clock advances by itself."""

    def online(self, node: int) -> bool:
        return True

    def outcome(self, node: int) -> Outcome | None:
        """Unknown on the wall clock: the Grid tells when the reply comes."""
        return None

    def next_online(self, node: int) -> float:
        return self.now()

    def all_online(self) -> bool:
        """Whether every node is online whenever asked (the wall clock: it cannot know)."""
        return True


class WallClock(Clock):
    """Wall-clock time since the clock was made; every client counts as online."""


class SimulatedClock(Clock):
    """Simulated seconds: task durations and availability come from a ClientModel."""

    simulated = True

    def __init__(self, model: ClientModel) -> None:
        self.model = model
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def bind(self, nodes: Iterable[int]) -> None:
        self.model.bind(nodes)

    def advance_to(self, t: float) -> None:
        """Move time forward to ``t`` (never backwards)."""
        if not math.isfinite(t):
            raise ValueError(f"cannot advance the simulated clock to {t}")
        self._now = max(self._now, float(t))

    def online(self, node: int) -> bool:
        return self.model.online(node, self._now)

    def outcome(self, node: int) -> Outcome:
        """When a task given to ``node`` now ends: its reply, or the client going offline."""
        start = self._now
        end = start + self.model.duration(node, start)
        off = self.model.offline_between(node, start, end)
        return Outcome(start, end) if off is None else Outcome(start, off, lost=True)

    def next_online(self, node: int) -> float:
        return self.model.next_online(node, self._now)

    def all_online(self) -> bool:
        """Whether the client model has every node online always (``always_online``, where
        the model says; else False)."""
        always = getattr(self.model, "always_online", None)
        return bool(always()) if always is not None else False
