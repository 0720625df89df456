"""The secure-aggregation policy: what a session must satisfy for its promise to hold.

SecAgg+ promises the server learns only the sum of at least ``min_survivors`` clients
(Bell et al., CCS 2020). That needs, and both state machines check:

- a communication graph of degree k >= ``min_neighbors`` (3), or the full graph
  (k = n-1, SecAgg of Bonawitz et al., CCS 2017). With k = 1 the graph is a perfect
  matching: the server rebuilds each pair's sum from the masked vectors and the revealed
  self-masks; with k = 2 it is one cycle, which any two dropouts split;
- a connected graph: the server learns the sum of every connected component on its own.
  The graph (a Harary graph over a seeded permutation, :mod:`privacy.secagg.graph`) is
  k-connected, so only k = 1 with n > 2 (a perfect matching) fails this, whatever the
  seed; each client checks it;
- a threshold t > k/2: fewer than half of a client's neighbours never rebuild its secrets,
  and two disjoint groups of neighbours never rebuild both (t = 1 makes a share the
  secret itself);
- at least ``min_survivors`` (3) clients in the revealed sum: the server requests no
  unmasking share below it, and a client answers no request that lists fewer.

``corrupt_fraction`` (gamma) is the fraction of clients assumed to collude with the
server when the degree is chosen automatically (:func:`privacy.secagg.default_k`: no
client may have t corrupt neighbours except with probability 2^-40). Its default,
``DEFAULT_CORRUPT_FRACTION`` = 0.05 (in :mod:`privacy.secagg.params`, with the
minimums), is the corrupt fraction of Bell et al.'s worked example (10^4 clients,
"withstanding up to 5% corrupt clients and 5% dropouts"). Assuming none (gamma = 0)
leaves, at n = 100 (k = 31, t = 16) with a third of the clients colluding, about 2.7
clients per round exposed. With 10% dropouts planned it costs little: k = 34 instead of
31 at n = 100, 38 instead of 35 at n = 1000, 41 at 10^4 (unchanged); up to about n = 50
the full graph is chosen either way. Raising it to 0.1 needs k = 56 at n = 100 (60 at
1000); at 1/3 the full graph up to n = 100 and k = 532 at n = 1000. A client's masking
cost grows like k + 1.

A policy only ever gets stricter where a user can reach it: the scenario's ``[secagg]``
section and a client's node config raise the minimums, never lower them. Weaker
policies exist for tests of the protocol mechanics at tiny n, built explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from privacy.secagg.errors import ProtocolError
from privacy.secagg.graph import graph_connected
from privacy.secagg.params import (
    DEFAULT_CORRUPT_FRACTION,
    MIN_NEIGHBORS,
    MIN_SURVIVORS,
    SessionParams,
)


@dataclass(frozen=True)
class SecAggPolicy:
    """The minimums a session must meet; :data:`DEFAULT_POLICY` is the strict one."""

    min_neighbors: int = MIN_NEIGHBORS
    min_survivors: int = MIN_SURVIVORS
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION
    require_majority: bool = True  # t > k/2
    require_connected: bool = True

    def __post_init__(self) -> None:
        if self.min_neighbors < 1 or self.min_survivors < 1:
            raise ValueError("min_neighbors and min_survivors must be >= 1")
        if not 0.0 <= self.corrupt_fraction < 1.0:
            raise ValueError(f"corrupt_fraction must be in [0, 1), got {self.corrupt_fraction}")

    def raised(self, *, min_neighbors: int | None = None,
               min_survivors: int | None = None) -> SecAggPolicy:
        """This policy with minimums raised (a value below the current one is refused)."""
        for name, value, floor in (("min_neighbors", min_neighbors, self.min_neighbors),
                                   ("min_survivors", min_survivors, self.min_survivors)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < floor):
                raise ValueError(f"{name} can only be raised: must be an integer >= {floor}, "
                                 f"got {value!r}")
        return SecAggPolicy(min_neighbors or self.min_neighbors,
                            min_survivors or self.min_survivors, self.corrupt_fraction,
                            self.require_majority, self.require_connected)

    def violation(self, config: SessionParams) -> str | None:
        """Why ``config`` is below this policy, or None when it meets it."""
        n, k, t = config.n, config.k, config.t
        if n < self.min_survivors:
            return (f"{n} participants can never give the {self.min_survivors} survivors a "
                    "sum must have")
        if k < self.min_neighbors and k != n - 1:
            return (f"k = {k} neighbours is below the minimum {self.min_neighbors} "
                    f"(or the full graph, k = {n - 1})")
        if self.require_majority and 2 * t <= k:
            return f"threshold t = {t} is not more than half of k = {k} (need t >= {k // 2 + 1})"
        if self.require_connected and not graph_connected(n, k, config.seed):
            return f"the communication graph (n = {n}, k = {k}) from the seed is disconnected"
        return None

    def check(self, config: SessionParams) -> None:
        """ProtocolError naming the rule when ``config`` is below this policy."""
        why = self.violation(config)
        if why is not None:
            raise ProtocolError(f"session below the secure-aggregation policy: {why}")

    def survivors_violation(self, count: int) -> str | None:
        """Why a sum of ``count`` clients must not be revealed, or None."""
        if count < self.min_survivors:
            noun = "survivor" if count == 1 else "survivors"
            return (f"{count} {noun}, fewer than the minimum {self.min_survivors}: "
                    "the sum would expose too few clients' inputs")
        return None


DEFAULT_POLICY = SecAggPolicy()
#: For tests of the protocol mechanics at tiny n (k = 1, two clients): never a default.
MECHANICS_ONLY = SecAggPolicy(min_neighbors=1, min_survivors=1, require_majority=False,
                              require_connected=False)
