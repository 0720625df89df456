"""``[engine]``: how the simulation engines run the clients.

The Flower (Ray) engine (``fedring simulate --engine flower``): each client (a Flower
virtual SuperNode's ClientApp) gets ``client_cpus`` CPUs and a ``client_gpus`` share of a
GPU, so Ray runs as many at once as the cluster holds. ``ray_address`` joins an existing
Ray cluster (``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the
others); empty starts a Ray instance for the run on this machine, or joins the one
``RAY_ADDRESS`` names.

The in-process engine: ``vectorize`` trains a round's clients as one batched computation
(``client.batched_training``) when they share the model and optimizer: ``false`` (the default: one
client after the other, small models back to back, ``client.vectorized``), ``"auto"``
(cohorts of two or more clients that can be vectorized and whose stacked parameters fit
one batch, ``client.vectorized.STACK_BUDGET``, of a model of at most
``client.vectorized.AUTO_MAX_DIM`` parameters; the others as with ``false``, with one log
line per reason) or ``true`` (every cohort that can be, in batches that fit, with a
warning per reason when one cannot). ``node_cache``: how many nodes' contexts stay in
memory (default 10,000; 0: no bound); the least recently sampled others' node state goes
to a SQLite file in a temporary folder and comes back exactly when the node is sampled
again (``simulations.node_states``). ``threads``: the intra-op threads each client trains
on: ``"auto"`` (the default) by the model's size, one below 100,000 parameters, else the
process's setting; 0 the process's setting; a number that many
(``simulations.client_threads``; small models only wait on a second thread).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# "auto", "host:port", "ray://host:port", "local" (what ray.init accepts as an address)
_ADDRESS = re.compile(r"^(auto|local|(ray://)?[A-Za-z0-9_.\-\[\]:]+:\d+)$")
VECTORIZE_CHOICES = ("auto", True, False)


@dataclass(frozen=True)
class EngineConfig:
    """Client resources and the Ray cluster of the Flower engine; vectorized cohorts on
    the in-process engine."""

    client_cpus: float = 1.0
    client_gpus: float = 0.0
    ray_address: str = ""
    # A factory, not a plain default, so that the section accepts a string or a bool.
    vectorize: Any = field(default_factory=lambda: False)
    node_cache: int = 10_000
    threads: Any = field(default_factory=lambda: "auto")  # a number or "auto"

    def __post_init__(self) -> None:
        if self.client_cpus <= 0:
            raise ValueError(f"engine.client_cpus must be > 0 (CPUs per client), got "
                             f"{self.client_cpus}")
        if self.client_gpus < 0:
            raise ValueError(f"engine.client_gpus must be >= 0 (a share of a GPU per client, "
                             f"e.g. 0.25 puts four clients on one GPU), got {self.client_gpus}")
        if self.ray_address and not _ADDRESS.match(self.ray_address):
            raise ValueError(f"engine.ray_address '{self.ray_address}' is not a Ray address: "
                             "use HOST:PORT of the head (e.g. 10.0.0.1:6379), "
                             "ray://HOST:10001, or auto (the cluster this machine joined)")
        if not any(self.vectorize is c or self.vectorize == c for c in VECTORIZE_CHOICES
                   if type(c) is type(self.vectorize)):
            raise ValueError(f"engine.vectorize must be \"auto\", true or false, got "
                             f"{self.vectorize!r}")
        if isinstance(self.node_cache, bool) or not isinstance(self.node_cache, int) \
                or self.node_cache < 0:
            raise ValueError(f"engine.node_cache must be a whole number >= 0 (node contexts "
                             f"kept in memory; 0: no bound), got {self.node_cache!r}")
        if self.threads != "auto" and (isinstance(self.threads, bool)
                                       or not isinstance(self.threads, int) or self.threads < 0):
            raise ValueError(f"engine.threads must be \"auto\" (one for models under 100,000 "
                             f"parameters) or a whole number >= 0 (intra-op threads per "
                             f"client; 0: the process's setting), got {self.threads!r}")

    @property
    def node_cache_bound(self) -> int | None:
        """``node_cache`` for the in-process engine: None for no bound."""
        return self.node_cache or None

    def backend_config(self) -> dict[str, Any]:
        """Flower's Ray backend config: ``client_resources`` per ClientApp and the
        ``init_args`` Flower passes to ``ray.init`` (the address, when one is given)."""
        init_args: dict[str, Any] = {}
        if self.ray_address:
            init_args["address"] = self.ray_address
        return {"client_resources": {"num_cpus": self.client_cpus,
                                     "num_gpus": self.client_gpus},
                "init_args": init_args}
