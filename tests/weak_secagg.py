"""Secure-aggregation settings of a server configured below the policy, for tests that
check the clients hold the line."""

from __future__ import annotations

from privacy.secagg import MECHANICS_ONLY, SecAggPolicy
from server.secagg_config import SecAggScenarioConfig


class WeakSettings(SecAggScenarioConfig):
    """A server configured below the policy: the graph it is told to use, no checks."""

    forced: tuple[int, int] = (0, 0)

    def graph(self, n: int) -> tuple[int, int]:
        return self.forced

    @property
    def policy(self) -> SecAggPolicy:
        return MECHANICS_ONLY
