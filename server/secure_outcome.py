"""What one secure round produced: :class:`SecureRoundOutcome`, the sum and each
participant's fate, as ``server.secagg_session`` returns it; the round's session record
(``server.rounds.RoundSession``) that the run loop stores and shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from privacy.secagg.eval_words import EvalTotals
from server.store import UpdateRecord

if TYPE_CHECKING:
    from server.store import Store


REFUSED = "message refused"  # an error reply of a client that refused what it was sent


def with_refusals(abort_reason: str | None, errors: dict[int, str]) -> str | None:
    """``abort_reason`` followed by the clients' own reason where some refused what the
    server sent (the most common refusal, and how many gave it): what an operator must fix
    (e.g. nodes without the SecAgg+ identity a malicious session needs) rather than the
    count of clients left that the server saw."""
    refused = [why for why in errors.values() if REFUSED in why]
    if abort_reason is None or not refused:
        return abort_reason
    reason = max(sorted(set(refused)), key=refused.count)
    count = refused.count(reason)
    return f"{abort_reason}; {count} client{'s' if count > 1 else ''} answered: {reason}"


@dataclass
class SecureRoundOutcome:
    """What one secure round produced and what happened to each participant."""

    status: str  # "completed" | "aborted"
    participants: list[int]
    k: int = 0
    t: int = 0
    scale: float = 0.0
    weighted_sum: np.ndarray | None = None  # sum of w_i * clip(delta_i), float64
    total_weight: float = 0.0
    survivors: list[int] = field(default_factory=list)
    dropouts: dict[str, list[int]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # error replies (dropouts)
    abort_reason: str | None = None
    replies: int = 0  # answers to the first (training) message
    masks_removed: int = 0  # masks the server expanded to unmask (self + dropped peers')
    stage_seconds: dict[str, float] = field(default_factory=dict)  # wall, with messaging
    server_seconds: dict[str, float] = field(default_factory=dict)  # inside SecAggServer
    server_cpu_seconds: dict[str, float] = field(default_factory=dict)  # its CPU time
    noise_multiplier: float | None = None  # distributed DP: what the decoded sum's noise is
    round: int = 0
    clip_range: float = 0.0  # the round's per-coordinate range (0: distributed DP)
    coordinates: int = 0  # model coordinates in each client's vector
    clipped: int | None = None  # values the survivors clipped (None: not in the sum)
    examples: float = 0.0  # the survivors' examples (those reporting a loss), from the sum
    loss_sum: float = 0.0  # their sum of examples * train_loss, from the sum
    evaluation: EvalTotals | None = None  # a secure evaluation's decoded totals
    security: str = "semi_honest"  # the threat model the session held against

    def session_record(self) -> dict[str, Any]:
        """The stored secure-aggregation session (``Store.record_secagg_round``'s keys)."""
        return {"status": self.status, "k": self.k, "t": self.t,
                "participants": self.participants, "dropouts": self.dropouts,
                "survivors": self.survivors, "rejected": self.rejected,
                "excluded": self.excluded, "abort_reason": self.abort_reason,
                "seconds": self.stage_seconds, "security": self.security}

    def save(self, store: Store, run_id: str, rnd: int) -> None:
        """Store the session as round ``rnd``'s (``Store.record_secagg_round``)."""
        store.record_secagg_round(run_id, round=rnd, **self.session_record())

    def shown(self) -> dict[str, float]:
        """For the round's line: the survivors and whether the session aborted."""
        return {"secure_survivors": float(len(self.survivors)),
                "secure_aborted": float(self.status == "aborted")}

    def train_loss(self) -> dict[str, float]:
        """The survivors' example-weighted mean training loss, decoded from the sum's
        totals (empty when no survivor reported a loss, or under distributed DP)."""
        if self.status != "completed" or not self.examples > 0:
            return {}
        return {"train_loss": self.loss_sum / self.examples}

    def metrics(self) -> dict[str, float]:
        """The round's figures from the sum: ``train_loss``, ``secagg_clipped`` and its
        fraction of the coordinates summed, and the round's ``secagg_clip_range``."""
        if self.clipped is None:
            return {}
        summed = self.coordinates * len(self.survivors)
        return {**self.train_loss(), "secagg_clipped": float(self.clipped),
                "secagg_clipped_fraction": self.clipped / summed if summed else 0.0,
                "secagg_clip_range": self.clip_range}

    def update_records(self) -> list[UpdateRecord]:
        """One record per participant: accepted survivor, dropped or rejected (why)."""
        stage_of = {node: name for name, nodes in self.dropouts.items() for node in nodes}
        out = []
        for node in self.participants:
            cid = str(node)
            if node in self.rejected:
                out.append(UpdateRecord(cid, "rejected", reason=self.rejected[node]))
            elif node in self.survivors and self.status == "completed":
                late = ("no consistency signature" if stage_of.get(node) == "consistency_check"
                        else "no unmask reply")
                reason = (f"masked input counted; {late} ({self.errors[node]})"
                          if node in self.errors else None)
                out.append(UpdateRecord(cid, "accepted", reason=reason))
            elif node in stage_of:
                why = self.errors.get(node, "no reply before the deadline")
                out.append(UpdateRecord(cid, "dropped",
                                        reason=f"dropped at stage {stage_of[node]}: {why}"))
            elif node in self.excluded:
                out.append(UpdateRecord(cid, "dropped", reason=self.excluded[node]))
            else:
                out.append(UpdateRecord(cid, "rejected",
                                        reason=f"secure round aborted: {self.abort_reason}"))
        return out
