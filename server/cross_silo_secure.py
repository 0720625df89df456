"""Secure cross-silo rounds: SecAgg+ through the server, the masked vectors summed over a ring.

With ``[secagg] enabled`` and ``[driver] kind = "cross_silo"`` each silo is a SecAgg+
client (``client.secure_client``) and the round is a secure round
(``server.secagg_session.SecAggSession``) whose masked-input stage runs over the ring:

    train.secagg   model + SETUP        -> ADVERTISE_KEYS   (the silo trains first)
    query.secagg   PUBLIC_KEYS          -> SHARE_KEYS
    query.cross_silo FORWARDED_SHARES   -> digest of the masked sum (ring rank 0: the sum)
                   + the silo's ring place   (each silo masks its quantized update, or its
                                              noisy integer update under distributed DP,
                                              and allreduces the words mod 2^bits)
    query.secagg   CONSISTENCY_CHECK    -> CONSISTENCY_SIGNATURE  (secagg.security =
                                              "malicious" only: each silo signs the
                                              survivor set)
    query.secagg   UNMASK_REQUEST       -> UNMASK_RESPONSE  (self-mask shares)

The server checks the digests as in a plain cross-silo round, hands the masked sum to
the session (``SecAggServer.receive_sum``), which never holds one silo's vector, then
removes the self-masks and decodes the sum. Silos that do not answer a key, consistency
or unmasking stage drop out as in any secure round (the ring is formed from those still
in the protocol) and take no further part. A ring that fails fails the round as in plain
cross-silo rounds: masked vectors cannot be taken back out of a partial sum, so there is
no recovery inside the ring.

Each silo's masked vector carries its stat words (values clipped, examples,
example-weighted loss) like any secure client's, so the ring's sum gives the round's
training loss and clipped count without any silo's figure in the clear.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict

from client.protocol.ring import CROSS_SILO_ACTION, RingKey, RingRecord
from client.protocol.secagg import SecAggKey, SecAggRecord
from privacy.secagg import SecAggServer
from server.cross_silo import CrossSiloOutcome, CrossSiloRounds, judge
from server.rounds import RoundResult
from server.secagg_session import TrainStart
from server.secure_aggregation import SecureAggregation, secure_result
from server.secure_outcome import SecureRoundOutcome
from server.store import UpdateRecord

KEY_STAGES = ("advertise_keys", "share_keys", "consistency_check",
              "unmasking")  # dropouts there are the silo's


class RingStage:
    """The masked-input stage of one secure cross-silo round, over the ring."""

    def __init__(self, rounds: CrossSiloRounds, run_id: str, rnd: int,
                 order: list[int]) -> None:
        self.rounds, self.run_id, self.rnd, self.order = rounds, run_id, rnd, order
        self.outcome: CrossSiloOutcome | None = None  # the ring's verdict, once it ran
        self.failure = ""  # why the session got no masked sum
        self.blamed: dict[int, str] = {}  # silos whose shares failed authentication

    def __call__(self, session: SecAggServer, outbox: dict[int, bytes]) -> None:
        members = [n for n in self.order if n in outbox]  # ring order, still in the protocol
        least = max(2, session.policy.min_survivors)
        if len(members) < least:
            self.failure = (f"{len(members)} silo(s) left after the key stages, fewer than "
                            f"secagg.min_survivors = {least}: no ring is formed and no sum "
                            "revealed")
            return
        rings = self.rounds.ring_records(self.run_id, self.rnd, members,
                                         **{RingKey.BITS: session.config.bits})
        messages = [Message(RecordDict({
            SecAggRecord.PROTOCOL: ConfigRecord({SecAggKey.MSG: outbox[node]}),
            RingRecord.SPEC: ring}), node, f"query.{CROSS_SILO_ACTION}", group_id=str(self.rnd))
                    for node, ring in zip(members, rings, strict=True)]
        replies = self.rounds.collect_ring(self.rnd, messages)
        outcome = judge(members, replies, session.config.dim, words=session.config.word_dtype,
                        joined=self.rounds.joined(messages))
        self.outcome = outcome
        if not outcome.completed:
            self.failure = f"cross-silo ring failed: {outcome.failure}"
            return
        failed = {s.node: s.failed for s in outcome.silos}
        if not session.receive_sum(members, outcome.aggregate, failed):
            self.failure = session.abort_reason or "the masked sum was refused"
            for s in outcome.silos:
                for v in s.failed:
                    self.blamed.setdefault(v, f"its share for silo {s.node} failed "
                                              "authentication (AES-GCM tag)")

    @property
    def ring_failed(self) -> bool:
        return self.outcome is not None and not self.outcome.completed


class SecureRing:
    """Secure cross-silo rounds: a SecAgg+ session whose masked-input stage is the ring."""

    central_model = True

    def __init__(self, secure: SecureAggregation) -> None:
        self.secure = secure

    def collect(self, rounds: CrossSiloRounds, run_id: str, rnd: int,
                order: list[int]) -> RoundResult:
        """One secure cross-silo round with the silos of ``order``, up to its result."""
        ctx, secure = rounds.ctx, self.secure
        version = ctx.state.version
        stage = RingStage(rounds, run_id, rnd, order)
        start = TrainStart(ctx.model_record(), ctx.train_config(rnd), ctx.layout.dim)
        session = secure.session(ctx, run_id, dp=ctx.dp,
                                 timeout=ctx.driver_config.deadline(ctx.fed.round_timeout_s))
        outcome = session.run(order, rnd, start, masked_input=stage,
                              on_reply=lambda i: ctx.reporter.client_done(rnd, i, len(order)))
        if stage.failure:
            outcome.abort_reason = stage.failure
        aggregate = secure.aggregate(outcome, ctx.dp, reporter=ctx.reporter)
        records = {r.client_id: r for r in outcome.update_records()}
        if stage.ring_failed:  # the ring's own verdict on its silos
            records.update({r.client_id: r for r in stage.outcome.records(version)})
        rounds.exclude(rnd, _blamed(outcome, stage))
        metrics = stage.outcome.metrics() if stage.outcome is not None else {"ring_silos": 0.0}
        if aggregate is not None:
            metrics["ring_total_weight"] = outcome.total_weight
        return secure_result(outcome, aggregate, num_sampled=len(order), metrics=metrics,
                             records=[records[str(n)] for n in outcome.participants],
                             status="failed" if aggregate is None and stage.ring_failed
                             else None, what="secure cross-silo round")


def _blamed(outcome: SecureRoundOutcome, stage: RingStage) -> dict[int, str]:
    """Silos that take no further part: silent or failing in a key or unmasking stage,
    refused by the protocol, or to blame for the ring's failure."""
    records: dict[str, UpdateRecord] = {r.client_id: r for r in outcome.update_records()}
    blamed = {}
    for name in KEY_STAGES:
        for node in outcome.dropouts.get(name, []):
            blamed[node] = records[str(node)].reason or f"dropped at stage {name}"
    for node, why in outcome.rejected.items():
        blamed[node] = f"refused by secure aggregation: {why}"
    if stage.ring_failed:
        blamed.update(stage.outcome.blamed)
    blamed.update(stage.blamed)
    return blamed
