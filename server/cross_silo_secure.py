"""Secure cross-silo rounds: SecAgg+ through the server, the masked vectors summed over a ring.

With ``[secagg] enabled`` and ``[driver] kind = "cross_silo"`` each silo is a SecAgg+
client (``client.secure_client``) and the round is a secure round
(``server.secure_round.secure_round``) whose masked-input stage runs over the ring:

    train.secagg   model + SETUP        -> ADVERTISE_KEYS   (the silo trains first)
    query.secagg   PUBLIC_KEYS          -> SHARE_KEYS
    query.cross_silo FORWARDED_SHARES   -> digest of the masked sum (ring rank 0: the sum)
                   + the silo's ring place   (each silo masks its quantized update, or its
                                              noisy integer update under distributed DP,
                                              and allreduces the words mod 2^bits)
    query.secagg   UNMASK_REQUEST       -> UNMASK_RESPONSE  (self-mask shares)

The server checks the digests as in a plain cross-silo round, hands the masked sum to
the session (``SecAggServer.receive_sum``), which never holds one silo's vector, then
removes the self-masks and decodes the sum. Silos that do not answer a key or unmasking
stage drop out as in any secure round (the ring is formed from those still in the
protocol) and take no further part. A ring that fails fails the round as in plain
cross-silo rounds: masked vectors cannot be taken back out of a partial sum, so there is
no recovery inside the ring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from client import secure_client as sc
from client import wire
from client.silo_app import BITS_KEY, CROSS_SILO_ACTION, RING_RECORD
from privacy.secagg import SecAggServer
from server.cross_silo import CrossSiloOutcome, RoundDone, judge
from server.secure_round import SecureRoundOutcome, secure_round, session_id
from server.store import UpdateRecord

if TYPE_CHECKING:
    from server.cross_silo import CrossSiloDriver

KEY_STAGES = ("advertise_keys", "share_keys", "unmasking")  # dropouts there are the silo's


class RingStage:
    """The masked-input stage of one secure cross-silo round, over the ring."""

    def __init__(self, driver: CrossSiloDriver, run_id: str, rnd: int,
                 order: list[int]) -> None:
        self.driver, self.run_id, self.rnd, self.order = driver, run_id, rnd, order
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
        rings = self.driver.ring_records(self.run_id, self.rnd, members,
                                         **{BITS_KEY: session.config.bits})
        messages = [Message(RecordDict({sc.RECORD: ConfigRecord({sc.MSG: outbox[node]}),
                                        RING_RECORD: ring}),
                            node, f"query.{CROSS_SILO_ACTION}", group_id=str(self.rnd))
                    for node, ring in zip(members, rings, strict=True)]
        replies = self.driver.exchange(self.rnd, messages)
        outcome = judge(members, replies, session.config.dim, words=session.config.word_dtype,
                        joined=self.driver.joined(messages))
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


def secure_ring_round(driver: CrossSiloDriver, run_id: str, rnd: int,
                      order: list[int]) -> RoundDone:
    """One secure cross-silo round with the silos of ``order``: aggregate and apply."""
    state, secure = driver.state, driver.secure
    version = state.version
    stage = RingStage(driver, run_id, rnd, order)
    outcome = secure_round(
        driver.grid, nodes=order, arrays=wire.model_record(driver.layout, state.params),
        config=driver.round_config(rnd), settings=secure.settings, weight_by=driver.weight_by,
        dim=driver.layout.dim, session=session_id(run_id), rnd=rnd,
        timeout=driver.driver.deadline(driver.fed.round_timeout_s), poll=driver.fed.poll_s,
        on_reply=lambda i: driver.reporter.client_done(rnd, i, len(order)), dp=driver.dp,
        masked_input=stage)
    if stage.failure:
        outcome.abort_reason = stage.failure
    secure.last = outcome
    driver.last = stage.outcome
    applied = outcome.weighted_sum is not None and outcome.total_weight > 0
    if applied:
        state.params = driver.pipeline.apply(state.params, _aggregate(driver, outcome),
                                             total_weight=outcome.total_weight,
                                             count=len(outcome.survivors))
        state.version += 1
    else:
        driver.reporter.message(f"round {rnd}: secure cross-silo round "
                                f"{'failed' if stage.ring_failed else outcome.status}: "
                                f"{outcome.abort_reason or 'no weight'}; the model is unchanged")
    records = {r.client_id: r for r in outcome.update_records()}
    if stage.ring_failed:  # the ring's own verdict on its silos
        records.update({r.client_id: r for r in stage.outcome.records(version)})
    driver.exclude(rnd, _blamed(outcome, stage))
    driver.store.record_secagg_round(
        run_id, round=rnd, status=outcome.status, k=outcome.k, t=outcome.t,
        participants=outcome.participants, dropouts=outcome.dropouts,
        survivors=outcome.survivors, rejected=outcome.rejected, excluded=outcome.excluded,
        abort_reason=outcome.abort_reason, seconds=outcome.stage_seconds)
    metrics = stage.outcome.metrics() if stage.outcome is not None else {"ring_silos": 0.0}
    if applied:
        metrics["ring_total_weight"] = outcome.total_weight
    status = ("completed" if applied else "failed" if stage.ring_failed
              else "aborted" if outcome.status == "aborted" else "failed")
    return RoundDone(applied=applied, status=status,
                     records=[records[str(n)] for n in outcome.participants],
                     metrics=metrics, replies=outcome.replies,
                     noise_multiplier=outcome.noise_multiplier)


def _aggregate(driver: CrossSiloDriver, outcome: SecureRoundOutcome) -> np.ndarray:
    """The decoded sum as the pipeline takes it, as in a sync secure round: the mean (or
    the sum); central DP: the sum (the pipeline noises and divides); distributed DP: the
    noisy sum over the expected count, a number that does not depend on the data."""
    dp = driver.dp
    divisor = 1.0 if driver.combine == "sum" else outcome.total_weight
    if dp is not None:
        divisor = 1.0 if dp.config.mode == "central" else float(dp.clients_per_round)
    return (outcome.weighted_sum / divisor).astype(np.float32)


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
