"""The ``[driver]`` and ``[clients]`` scenario sections, validated.

``[driver]`` names the driver (an entry of ``server.drivers``: sync, FedAsync, FedBuff,
cross-silo, gossip or one registered later), its straggler handling and the staleness keys
(``server.config.StalenessConfig``, which the aggregation pipeline applies); ``[clients]``
describes simulated client speed and availability.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import StalenessConfig, check_choice
from server.drivers import driver, driver_names

LATE_POLICIES = ("drop", "carry")
FEDASYNC_SECAGG = ("driver.kind 'fedasync' applies each update on its own, and a single "
                   "update cannot be hidden in a sum: with secagg.enabled = true use "
                   "driver.kind 'fedbuff' (one secure sum per buffer of driver.buffer_size "
                   "updates) or 'sync'")


# driver.target_on -> the round metric driver.target_accuracy is compared with
TARGET_METRICS = {"central": "accuracy", "federated": "federated_accuracy",
                  "personal": "federated_accuracy_personal"}


@dataclass(frozen=True)
class DriverConfig:
    """How rounds run: the driver kind, buffer, concurrency, staleness and deadline.

    ``concurrency`` is how many clients train at once: for the async drivers the number
    of tasks kept in flight, for sync a cap on the clients sampled per round; 0 means the
    federation's clients per round. ``deadline_s`` 0 means no deadline (wait up to
    ``federation.round_timeout_s``); late sync updates are dropped or carried into the
    next aggregate (``late_policy``). ``max_staleness`` -1 means no bound;
    ``target_accuracy`` 0 means train for all ``federation.rounds``; ``target_on`` says
    which accuracy it means (:data:`TARGET_METRICS`). For the async
    drivers ``federation.rounds`` counts applied aggregates (model versions) and
    ``deadline_s`` bounds each client's task; ``alpha`` is FedAsync's mixing weight and
    ``buffer_size`` FedBuff's K.
    """

    kind: str = "sync"
    buffer_size: int = 10
    concurrency: int = 0
    staleness: str = StalenessConfig.staleness
    staleness_a: float = StalenessConfig.staleness_a
    staleness_b: int = StalenessConfig.staleness_b
    max_staleness: int = StalenessConfig.max_staleness
    alpha: float = 0.6
    deadline_s: float = 0.0
    late_policy: str = "drop"
    target_accuracy: float = 0.0
    target_on: str = "central"

    def __post_init__(self) -> None:
        check_choice("driver.kind", self.kind, driver_names())
        if self.buffer_size < 1:
            raise ValueError(f"driver.buffer_size must be >= 1, got {self.buffer_size}")
        if self.concurrency < 0:
            raise ValueError(f"driver.concurrency must be >= 0 (0: the federation's clients "
                             f"per round), got {self.concurrency}")
        StalenessConfig.of(self).check("driver")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"driver.alpha must be in (0, 1], got {self.alpha}")
        if not self.deadline_s >= 0:
            raise ValueError(f"driver.deadline_s must be >= 0 (0: no deadline), got "
                             f"{self.deadline_s}")
        check_choice("driver.late_policy", self.late_policy, LATE_POLICIES)
        if not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"driver.target_accuracy must be in [0, 1] (0: none), got "
                             f"{self.target_accuracy}")
        check_choice("driver.target_on", self.target_on, tuple(TARGET_METRICS))

    def target_metric(self) -> str:
        """The round metric ``target_accuracy`` is compared with: the central accuracy,
        the clients' example-weighted federated accuracy of the global model, or of their
        own models (``target_on`` central, federated, personal)."""
        return TARGET_METRICS[self.target_on]

    @property
    def is_async(self) -> bool:
        return driver(self.kind).asynchronous

    def concurrency_for(self, clients_per_round: int) -> int:
        """Clients training at once: the configured limit, else the clients per round."""
        return self.concurrency or clients_per_round

    def staleness_config(self) -> StalenessConfig:
        """The staleness function and bound, for the pipeline and the async drivers."""
        return StalenessConfig.of(self)

    def deadline(self, round_timeout_s: float) -> float:
        """Seconds the server waits for a reply (the deadline, else the round timeout)."""
        return self.deadline_s if self.deadline_s > 0 else round_timeout_s


@dataclass(frozen=True)
class ClientsConfig:
    """Simulated heterogeneity: per-client speed and availability on the simulated clock.

    A normal client's local training takes ``compute_s`` simulated seconds times its
    speed factor, drawn once per client from lognormal(0, ``speed_sigma``); a
    ``straggler_fraction`` of the clients (exactly, rounded) is ``straggler_slowdown``
    times slower. An ``offline_fraction`` of the clients alternates between online and
    offline periods (exponential, means ``online_s`` and ``offline_s``); work in progress
    when a client goes offline is lost.
    """

    compute_s: float = 1.0
    speed_sigma: float = 0.0
    straggler_fraction: float = 0.0
    straggler_slowdown: float = 10.0
    offline_fraction: float = 0.0
    online_s: float = 60.0
    offline_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.compute_s > 0:
            raise ValueError(f"clients.compute_s must be > 0, got {self.compute_s}")
        if not 0 <= self.speed_sigma <= 5:
            raise ValueError(f"clients.speed_sigma must be in [0, 5], got {self.speed_sigma}")
        for key in ("straggler_fraction", "offline_fraction"):
            value = getattr(self, key)
            if not 0 <= value <= 1:
                raise ValueError(f"clients.{key} must be in [0, 1], got {value}")
        if not self.straggler_slowdown >= 1:
            raise ValueError(f"clients.straggler_slowdown must be >= 1, got "
                             f"{self.straggler_slowdown}")
        if not (self.online_s > 0 and self.offline_s > 0):
            raise ValueError("clients.online_s and clients.offline_s must be > 0")
