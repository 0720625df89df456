"""Secure FedBuff: every buffer of K updates is summed under SecAgg+; the server sees the sum.

A client given a task trains on the model version it was sent and keeps its delta
(``train.secagg_hold``, see ``client.secure_client``), answering only "ready". Once
``size`` clients are ready, the server runs one SecAgg+ session with exactly those
clients (protocol round id: the buffer's store round, bound to the run) and learns
only ``sum_i w_i s(tau_i) clip(delta_i)`` and ``sum_i w_i``: ``w_i`` is the client's
example count capped at ``secagg.max_weight`` (1 with uniform weights) and ``s(tau_i)``
the staleness factor the server sends it with SETUP, so the weights are applied on the
clients. Their ratio is FedBuff's aggregate ``sum_i w_i s_i delta_i / sum_i w_i`` (see
``server.fedbuff``), which the server optimizer applies with its learning rate.

The server knows each ready client's base version, so an update beyond
``max_staleness`` is refused before the secure stages. A client that drops during them
is recovered by SecAgg+, or the buffer aborts: the model stays as it is and the run
goes on. Per update the server knows only its base version, staleness and factor: the
stored ``weight`` is s(tau); the example count and the norm stay hidden. The buffer's
training loss and clipped count come from the sum's stat words (``server.secagg_session``),
the example-weighted mean over the survivors, as a plain buffer's.

With ``secagg.security = "malicious"`` the buffer's session is a malicious-mode one like
any other (``server.secagg_session``): the SETUP says so, the clients sign their key
advertisements and the survivor set with their SecAgg+ identities, and the session
records the mode.

With top-k on a shared pattern (``[compression]``) the pattern is the buffer's round's:
each client picks those coordinates of the delta it holds once SETUP comes, so the
buffer's clients line up whatever model version each trained from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from flwr.app import ConfigRecord, Message

from client.protocol.secagg import SecAggKey, SecAggRecord
from server.inflight import Task
from server.reply_buffer import staleness_mean
from server.rounds import RoundResult, RunContext
from server.secagg_session import HeldStart
from server.secure_aggregation import SecureAggregation, secure_result
from server.secure_outcome import SecureRoundOutcome
from server.settle import mismatch
from server.store import UpdateRecord


class SecureBuffer:
    """Clients holding their trained updates; one secure sum once ``size`` are ready
    (a ``server.reply_buffer.ReplyBuffer``)."""

    def __init__(self, ctx: RunContext, secure: SecureAggregation, *, size: int,
                 staleness: Callable[[int], float], max_staleness: int | None) -> None:
        self.ctx = ctx
        self.secure = secure
        self.version = ctx.state.version
        self.size = size
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.ready: dict[int, int] = {}  # node -> base version, in arrival order
        self.outcome: SecureRoundOutcome | None = None

    @property
    def members(self) -> set[str]:
        return {str(node) for node in self.ready}

    @property
    def filled(self) -> int:
        return len(self.ready)

    @property
    def full(self) -> bool:
        return len(self.ready) >= self.size

    @property
    def aborted(self) -> bool:
        return self.outcome is not None and self.outcome.status == "aborted"

    @property
    def total_weight(self) -> float:
        """sum_i w_i over the survivors (0 before the sum or when it failed)."""
        return self.outcome.total_weight if self.outcome is not None else 0.0

    @property
    def count(self) -> int:
        """Updates in the applied sum."""
        done = self.outcome is not None and self.outcome.status == "completed"
        return len(self.outcome.survivors) if done and self.outcome is not None else 0

    def admit(self, task: Task, reply: Message) -> UpdateRecord | None:
        """A ready notice: None when its client joins the buffer, else the record of why
        not."""
        node, base_version = task.node, task.base_version
        tau = self.version - base_version

        def rejected(reason: str) -> UpdateRecord:
            return UpdateRecord(str(node), "rejected", reason=reason, base_version=base_version,
                                staleness=tau)

        if reply.has_error():
            return rejected(f"client error {reply.error.code}: {reply.error.reason}")
        if reply.metadata.src_node_id != node:
            return rejected(mismatch(node, reply.metadata.src_node_id))
        record = reply.content.get(SecAggRecord.PROTOCOL)
        version = record.get(SecAggKey.READY) if isinstance(record, ConfigRecord) else None
        if isinstance(version, bool) or version != base_version:
            return rejected(f"not a ready notice for model version {base_version} (secure "
                            f"FedBuff): got {version!r}")
        if self.max_staleness is not None and tau > self.max_staleness:
            return rejected(f"staleness {tau} exceeds max_staleness {self.max_staleness}")
        self.ready[node] = base_version
        return None

    def factors(self) -> dict[int, float]:
        """Each ready client's staleness factor s(version - base version)."""
        return {node: float(self.staleness(self.version - base))
                for node, base in self.ready.items()}

    def figures(self) -> dict[str, float]:
        """The ready clients' mean staleness (the training loss comes with the sum)."""
        return staleness_mean([self.version - base for base in self.ready.values()])

    def close(self, run_id: str, rnd: int) -> RoundResult:
        """The buffer's secure sum as FedBuff's aggregate, with the survivors' records."""
        outcome = self.finish(run_id, rnd)
        records = self.records()
        aggregate = self.secure.aggregate(outcome, None, reporter=self.ctx.reporter)
        return secure_result(outcome, aggregate, num_sampled=0, metrics={}, records=records,
                             what="secure aggregation of the buffer")

    def finish(self, run_id: str, rnd: int) -> SecureRoundOutcome:
        """Run the buffer's secure stages (dense, or on the round's shared top-k pattern:
        the clients pick its coordinates of the delta they hold when SETUP comes)."""
        ctx = self.ctx
        dim = ctx.layout.dim
        start = HeldStart(self.factors(), dim, sparse=self.secure.pattern(run_id, rnd, dim))
        session = self.secure.session(ctx, run_id, dp=None, timeout=ctx.fed.round_timeout_s)
        self.outcome = session.run(list(self.ready), rnd, start)
        return self.outcome

    def records(self) -> list[UpdateRecord]:
        """The buffer's update records, with base version, staleness and factor s(tau)."""
        assert self.outcome is not None, "finish() first"
        factors = self.factors()
        return [replace(r, base_version=self.ready[int(r.client_id)],
                        staleness=self.version - self.ready[int(r.client_id)],
                        weight=factors[int(r.client_id)])
                for r in self.outcome.update_records()]
