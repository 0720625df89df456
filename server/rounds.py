"""What every kind of round shares: the run's state and services, and the result a round
source hands to the run loop.

A *round source* (plain replies, a SecAgg+ sum, a FedBuff buffer, a ring sum across
silos) produces one :class:`RoundResult` per round; ``server.run_loop.RunLoop`` finishes
every round the same way (apply, version, evaluate, account, record, checkpoint, report).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from aggregation import Layout, Pipeline, Verdict
from client.protocol.train import train_config
from client.protocol.updates import model_record
from server.clock import Clock, WallClock
from server.config import FederationConfig
from server.dp_sgd import DPSGDLedger
from server.driver_config import DriverConfig
from server.reporter import Reporter
from server.scenario import ServerScenario
from server.store import EvalRecord, Store, UpdateRecord
from server.task import ServerTask
from server.wire_bytes import ByteCountingGrid

if TYPE_CHECKING:
    from server.dp import DPController


@dataclass
class RunState:
    """Everything that changes from round to round (what a checkpoint holds)."""

    params: np.ndarray
    version: int = 0
    round: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class RunContext:
    """One run's state and the services every round source uses."""

    def __init__(self, grid: Grid, *, scenario: ServerScenario, task: ServerTask,
                 pipeline: Pipeline, store: Store, reporter: Reporter,
                 dp: DPController | None = None, clock: Clock | None = None) -> None:
        self.grid = ByteCountingGrid(grid)  # bytes on the wire, per round and per run
        self.scenario = scenario
        self.config = dict(scenario.raw)  # the resolved scenario, as stored with the run
        self.fed: FederationConfig = scenario.federation
        self.driver_config: DriverConfig = scenario.driver
        self.seed = scenario.seed
        self.task = task
        self.pipeline = pipeline
        self.store = store
        self.reporter = reporter
        self.dp = dp
        self.dp_sgd = DPSGDLedger(self.config.get("train") or {})  # clients' DP-SGD figures
        self.clock: Clock = clock or WallClock()
        params, layout = task.initial_params()
        self.layout: Layout = layout
        # FedBN: the entries each client keeps (batch norm, buffers); None: all averaged
        self.local_mask = (layout.mask(layout.local) if scenario.aggregation.local_buffers
                           and any(layout.local) else None)
        self.state = RunState(params=params)
        self.task_json = json.dumps(task.task_spec(), sort_keys=True)

    def train_config(self, server_round: int, compression: str | None = None) -> ConfigRecord:
        """The config every training message carries: round, model version, task, seed, the
        compression request, FedBN's flag, for client-side centered clipping the centre, the
        client momentum and, on a resumed run, DP-SGD's prior rounds
        (``client.protocol.train.train_config``)."""
        return train_config(server_round, self.state.version, self.task_json, self.seed,
                            compression=compression,
                            local_buffers=self.scenario.aggregation.local_buffers,
                            center=self.pipeline.client_center(self.layout.dim),
                            client_momentum=self.scenario.aggregation.client_momentum,
                            dp_sgd_prior_rounds=self.dp_sgd.prior_rounds)

    def model_record(self) -> ArrayRecord:
        """The current model as the ``arrays`` record of a training message."""
        return model_record(self.layout, self.state.params)

    def resume_clock(self) -> None:
        """A resumed run's simulated clock goes on from its last recorded round."""
        if self.clock.simulated and self.state.history:
            self.clock.advance_to(self.state.history[-1].get("sim_time_s", 0.0))

    def wait_for_nodes(self) -> Sequence[int]:
        """Connected node ids once at least ``min_clients`` are there (else a clear error)."""
        return wait_for_nodes(self.grid, self.fed)


def wait_for_nodes(grid: Grid, fed: FederationConfig) -> Sequence[int]:
    """``grid``'s connected node ids once at least ``fed.min_clients`` are there, waiting up
    to ``fed.wait_for_nodes_s`` (else a clear error). A ``range`` (the in-process engine's
    nodes) is returned as it is, never listed."""
    deadline = time.monotonic() + fed.wait_for_nodes_s
    while True:
        ids = grid.get_node_ids()
        nodes = ids if isinstance(ids, range) else list(ids)
        if len(nodes) >= fed.min_clients:
            return nodes
        if time.monotonic() >= deadline:
            raise RuntimeError(f"only {len(nodes)} node(s) connected after "
                               f"{fed.wait_for_nodes_s:.0f} s, federation.min_clients is "
                               f"{fed.min_clients}: start more SuperNodes or lower "
                               "min_clients")
        time.sleep(fed.poll_s)


class RoundSession(Protocol):
    """A protocol session a round ran (a SecAgg+ sum: ``server.secure_outcome``), as the
    run loop sees it: a record to store and figures for the round's line."""

    def save(self, store: Store, run_id: str, rnd: int) -> None:
        """Store the session as round ``rnd``'s (called by the run loop, once)."""

    def shown(self) -> dict[str, float]:
        """The session's figures for the round's line (not stored with the round)."""


@dataclass
class RoundResult:
    """What one round produced, for the run loop to finish.

    ``aggregate`` is what the pipeline's post stages and server optimizer take (None:
    nothing is applied and the model keeps its version); ``noise_multiplier`` the noise
    actually in the sum when it differs from the plan's (distributed DP with dropouts);
    ``session`` the protocol session the round ran, if any.
    """

    aggregate: np.ndarray | None
    status: str  # "completed", "failed" or "aborted"
    records: list[UpdateRecord]
    num_sampled: int
    num_replies: int
    total_weight: float = 0.0
    count: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    noise_multiplier: float | None = None
    session: RoundSession | None = None
    note: str | None = None  # why the model is unchanged, for the user
    # the clients' own evaluations, where the round source made them (gossip: each silo's
    # model on its held-out split); else the run loop's federated evaluation, when due
    evaluations: list[EvalRecord] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Updates by fate: accepted, rejected, dropped."""
        return {fate: sum(r.fate == fate for r in self.records)
                for fate in ("accepted", "rejected", "dropped")}


class RoundSource:
    """Produces the run's rounds; ``RunLoop`` finishes each one. Subclasses implement
    :meth:`next_round` and override the other hooks where they need them.

    ``central_model`` False (gossip): the rounds produce no aggregate and there is no
    global model; a round counts as done when its status is "completed", and its metrics
    (the silos' own figures) are all the run loop records. Such runs keep no checkpoint
    and cannot be resumed: the models live on the silos."""

    central_model = True

    @contextmanager
    def session(self) -> Iterator[None]:
        """A context for the whole run (e.g. the silos' rendezvous); checks at start."""
        yield

    def next_round(self, run_id: str, rnd: int) -> RoundResult:
        """Run round ``rnd`` up to its result; the model in the run state is unchanged."""
        raise NotImplementedError

    def stop_reason(self) -> str | None:
        """Why no further round can run (None: it can)."""
        return None

    def traffic(self, grid: ByteCountingGrid) -> dict[str, float]:
        """The bytes up and down of the round last returned and of what ran after it (its
        federated evaluation), asked once per round by the run loop: by default all that
        ``grid`` counted since it was last asked."""
        return grid.since_last()

    def leftover(self) -> RoundResult | None:
        """At the end of the run: what arrived after the last round, as an aborted round
        for the run loop to record after it (None: nothing)."""
        return None

    def finish(self, run_id: str, summary: dict[str, Any]) -> None:
        """At the end of the run, once the loop recorded the rounds: add to the summary."""


def update_record(verdict: Verdict, metrics: dict[str, float] | None = None) -> UpdateRecord:
    """The stored record of a pipeline verdict."""
    return UpdateRecord(client_id=verdict.client_id,
                        fate="accepted" if verdict.accepted else "rejected",
                        reason=verdict.reason, num_examples=verdict.num_examples,
                        base_version=verdict.base_version, staleness=verdict.staleness,
                        norm=verdict.norm, weight=verdict.weight, metrics=metrics or {})


def mean_loss(losses: list[tuple[float, float]]) -> dict[str, float]:
    """``{"train_loss": ...}``: the example-weighted mean of (loss, examples), if any."""
    if not losses or sum(w for _, w in losses) <= 0:
        return {}
    return {"train_loss": float(np.average([v for v, _ in losses],
                                           weights=[w for _, w in losses]))}
