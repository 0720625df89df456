"""The ``[silo]`` scenario section: how silos meet over the ring in cross-silo rounds.

Cross-silo rounds run with ``[driver] kind = "cross_silo"`` (a ring sum) or ``"gossip"``
(each silo averages its own model with its neighbours', ``[gossip]``);
``server.settings_checks.check_cross_silo`` and ``check_gossip`` refuse the combinations they
cannot honour, at start, naming the key to change. With
``[secagg] enabled`` the ring sums masked vectors (``server.cross_silo_secure``); the
``[secagg]`` and ``[dp]`` checks then apply as for sync secure rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aggregation.gossip import TOPOLOGIES
from aggregation.ring import ALGORITHMS
from client.protocol.learners import LearnerSpec
from server.config import check_choice

CROSS_SILO = "cross_silo"
GOSSIP = "gossip"
SILO_DRIVERS = (CROSS_SILO, GOSSIP)  # the drivers whose rounds run among silos
RING_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class SiloConfig:
    """``[silo]``: the ring's rendezvous, timeouts and algorithm.

    The server hosts each round's rendezvous store on ``rendezvous_port`` (0: a free
    port) and tells silos to reach it at ``rendezvous_host``, which must be an address
    of the server's machine that every silo can reach. Silos wait for each other there
    for up to ``join_timeout_s`` (training times differ); once the ring runs, a silo
    that makes no progress for ``ring_timeout_s`` fails the round. ``backend`` "nccl"
    needs a GPU in every silo.

    ``learners`` > 1 trains that many replicas per silo process, synchronised by
    synchronous model averaging (Crossbow's SMA, ``client.silo.learners``): each step
    every learner moves ``sma_correction`` (alpha) of the way towards the silo's average
    model, which moves by the sum of those corrections plus ``sma_momentum`` (mu) times its
    previous step (Crossbow's Algorithm 1), so alpha times the silo's learners (processes x
    ``learners``) is at most 1; "auto" (the default) is 1 / the silo's learners, which
    moves the average model to the learners' mean. ``learners`` = 1 is DDP, unchanged.
    """

    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 0
    join_timeout_s: float = 120.0
    ring_timeout_s: float = 30.0
    algorithm: str = "ring"
    backend: str = "gloo"
    learners: int = 1
    sma_momentum: float = 0.5  # measured best of a small grid: benchmarks/crossbow.py
    sma_correction: Any = field(default_factory=lambda: "auto")  # a number or "auto"

    def __post_init__(self) -> None:
        self.learner_spec()  # bounds: LearnerSpec, which the silos read back
        if not self.rendezvous_host.strip():
            raise ValueError("silo.rendezvous_host must be an address silos can reach")
        if not 0 <= self.rendezvous_port < 65536:
            raise ValueError(f"silo.rendezvous_port must be a TCP port (0: any free port), "
                             f"got {self.rendezvous_port}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"silo.join_timeout_s must be > 0, got {self.join_timeout_s}")
        if not self.ring_timeout_s > 0:
            raise ValueError(f"silo.ring_timeout_s must be > 0, got {self.ring_timeout_s}")
        check_choice("silo.algorithm", self.algorithm, ALGORITHMS)
        check_choice("silo.backend", self.backend, RING_BACKENDS)

    def learner_spec(self) -> LearnerSpec:
        """What the silos' training messages carry (``client.protocol.learners``)."""
        correction = self.sma_correction
        if correction == "auto":
            correction = None
        elif isinstance(correction, bool) or not isinstance(correction, int | float):
            raise ValueError(f"silo.sma_correction must be a number in (0, 1 / "
                             f"silo.learners] or \"auto\", got {correction!r}")
        else:
            correction = float(correction)
        return LearnerSpec(learners=self.learners, momentum=self.sma_momentum,
                           correction=correction)

    def failure_grace_s(self) -> float:
        """How long the server waits, once a silo reported a failure, for a silo still
        silent: as long as that silo may wait at the rendezvous (``join_timeout_s``) and
        on a stalled ring (``ring_timeout_s``) before it gives up and reports, plus 5 s.
        Counted from when it joined the rendezvous, so the server never gives up first."""
        return self.join_timeout_s + self.ring_timeout_s + 5.0


@dataclass(frozen=True)
class GossipConfig:
    """``[gossip]``: the topology of gossip rounds.

    Every round the server draws the silos' graph, ``topology`` "ring" or "random" (a
    random connected graph of at most ``degree`` neighbours per silo, seeded by the run
    seed and the round), and its Metropolis–Hastings weights (``aggregation.gossip``).
    Each silo trains on its partition less its held-out split and evaluates its mixed
    model on that split (``[data] client_test_fraction``, as every client does).
    """

    topology: str = "ring"
    degree: int = 4

    def __post_init__(self) -> None:
        check_choice("gossip.topology", self.topology, TOPOLOGIES)
        if self.degree < 2:
            raise ValueError(f"gossip.degree must be >= 2 (the random topology contains a "
                             f"ring), got {self.degree}")
