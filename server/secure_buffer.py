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
training loss and clipped count come from the sum's stat words (``server.secure_round``),
the example-weighted mean over the survivors, as a plain buffer's.

With top-k on a shared pattern (``[compression]``) the pattern is the buffer's round's:
each client picks those coordinates of the delta it holds once SETUP comes, so the
buffer's clients line up whatever model version each trained from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

from client.protocol.secagg import SecAggKey, SecAggRecord
from server.secure_round import SecureRoundOutcome, SecureSettings, secure_round, session_id
from server.settle import mismatch
from server.store import UpdateRecord


class SecureBuffer:
    """Clients holding their trained updates; one secure sum once ``size`` are ready."""

    def __init__(self, secure: SecureSettings, *, version: int, size: int,
                 staleness: Callable[[int], float], max_staleness: int | None) -> None:
        self.secure = secure
        self.version = version
        self.size = size
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.ready: dict[int, int] = {}  # node -> base version, in arrival order
        self.outcome: SecureRoundOutcome | None = None

    @property
    def members(self) -> set[str]:
        return {str(node) for node in self.ready}

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

    def offer(self, node: int, base_version: int, reply: Message) -> UpdateRecord | None:
        """A ready notice: None when ``node`` joins the buffer, else the record of why not."""
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

    def finish(self, grid: Grid, *, dim: int, run_id: str, rnd: int, timeout: float,
               poll: float) -> SecureRoundOutcome:
        """Run the buffer's secure stages (dense, or on the round's shared top-k pattern:
        the clients pick its coordinates of the delta they hold when SETUP comes)."""
        self.outcome = secure_round(
            grid, nodes=list(self.ready), arrays=None, config=None,
            settings=self.secure.round_settings(None), weight_by=self.secure.weight_by,
            dim=dim,
            session=session_id(run_id), rnd=rnd, timeout=timeout, poll=poll,
            held=self.factors(), sparse=self.secure.pattern(run_id, rnd, dim))
        return self.outcome

    def records(self) -> list[UpdateRecord]:
        """The buffer's update records, with base version, staleness and factor s(tau)."""
        assert self.outcome is not None, "finish() first"
        factors = self.factors()
        return [replace(r, base_version=self.ready[int(r.client_id)],
                        staleness=self.version - self.ready[int(r.client_id)],
                        weight=factors[int(r.client_id)])
                for r in self.outcome.update_records()]
