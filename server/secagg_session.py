"""A SecAgg+ session over a Flower Grid: one cohort, one round; the server learns only a sum.

Message flow (client side in ``client.secure_client``), one push/pull per stage, each
with the deadline ``federation.round_timeout_s``:

    train.secagg  model + SETUP          -> ADVERTISE_KEYS   (the client trains first)
    query.secagg  PUBLIC_KEYS            -> SHARES_AND_INPUT (shares + masked vector,
                                                              uint8 ArrayRecord)
    query.secagg  SHARES_AND_UNMASK      -> UNMASK_RESPONSE  (the forwarded shares with
                                                              the unmask request)

That is the merged flow (``privacy.secagg.params.MERGED``): three round trips, four in
the malicious mode (the shares then ride on the consistency check: SHARES_AND_CHECK ->
CONSISTENCY_SIGNATURE, then UNMASK_REQUEST -> UNMASK_RESPONSE). When a client sent no
shares, the session falls back to the classic flow's stage FORWARDED_SHARES ->
MASKED_INPUT before the unmask request (or the consistency check); a session whose
masked-input stage runs elsewhere (``masked_input``: a ring of silos) always runs it.

Keys advertised a round ahead (``pending``, :mod:`privacy.secagg.ahead`; sync training
rounds with ``secagg.advertise_ahead``): each client's UNMASK_RESPONSE also carries its
key advertisement for the next round. When every node of the next round's cohort has one
for that round, the training instruction carries SETUP and PUBLIC_KEYS at once
(SETUP_AND_KEYS) and the client answers it, once trained, with SHARES_AND_INPUT: two
exchanges, three in the malicious mode (two with ``secagg.presign``: the client signs the
survivor set, the whole advertisement list, with its masked input, PRESIGNED_INPUT, and
the consistency check is skipped; a listed client that drops aborts the round).
Otherwise the round runs the flow above. The first exchange's seconds are the training
stage's (``advertise_keys``), the share-keys work included when it rides on it; its
non-responders are then dropouts of stage ``share_keys``.

A node that does not answer in time, or answers with an error, is a dropout of that
stage; a client that refuses a session below its policy (``privacy.secagg.policy``)
answers with an error naming the rule, which its update record keeps. The session meets
``settings.policy``: fewer than ``secagg.min_survivors`` survivors abort the round
before any unmasking share is requested. ``privacy.secagg.SecAggServer`` decides the
rest: it recovers the exact sum of the survivors' quantized inputs, or aborts without
asking for any share that could reveal an input. The sum is decoded into
sum(w_i * clip(delta_i)) and sum(w_i), and the mean (or the sum, for ``combine =
"sum"``) goes through the pipeline's server optimizer like any other aggregate. An
aborted round leaves the model unchanged.

The figures the round needs besides the model also come out of the sum, never one
client's in the clear: each client's vector carries, after its weight, the number of
values it clipped, its example count and its example-weighted training loss
(``privacy.secagg.quantize.StatWords``), so the server learns their totals: the
round's ``train_loss`` (the example-weighted mean, as a plain round's) and
``secagg_clipped`` (with ``secagg_clipped_fraction`` of the coordinates summed and the
round's ``secagg_clip_range``, set by ``server.secure_range``). Distributed DP sends
none of them: its noisy sum is all the server learns.

How the first message differs is the session's *start*: :class:`TrainStart` (a
training round: ``train.secagg`` with the model and the train config),
:class:`HeldStart` (secure FedBuff, whose clients hold their trained deltas:
``query.secagg`` with SETUP and a staleness factor) or :class:`EvalStart` (a secure
evaluation, ``server.secure_evaluation``: ``evaluate.secagg`` with the model and an
evaluate config; each client's vector holds only its evaluation totals,
``privacy.secagg.eval_words``, and the session decodes their sums).

Top-k on a shared pattern (``server.compression.SharedPattern``): the SETUP record also
carries the compression request, the clients mask only the round's ``k`` coordinates
plus the weight (SecAgg+ vectors of ``k + 1`` words), and the unmasked sum is scattered
back into the model's ``d`` coordinates before the server optimizer. Each round records
its bytes on the wire (``server.wire_bytes``) in its metrics.

Differential privacy (``server.dp``): with central DP each client clips its delta below
the clip norm C by the rounding's worst case, so its decoded contribution stays within C
(``server.secure_aggregation.central_dp_clip`` refuses at start a scale that would leave
clients less than half of C), and the pipeline noises the decoded sum and divides by the
expected (public) number of clients per round, however many survive; with distributed DP
each client sends its clipped, rotated, scaled and rounded delta plus its share of
integer noise (the round's plan travels in the SETUP record), the server decodes the
noisy sum, and before asking for any unmasking share it checks that the survivors' noise
keeps the run within its epsilon budget (else it aborts: the sum is never revealed).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from client.protocol.keys import ConfigKey
from client.protocol.secagg import (
    SecAggAction,
    SecAggKey,
    SecAggRecord,
    eval_setup,
    protocol_payload,
)
from privacy.dp import DistributedDPPlan, distributed_decode
from privacy.secagg import SecAggServer, SessionParams, Stage, Status, dequantize_weighted
from privacy.secagg.ahead import PendingAdverts
from privacy.secagg.eval_words import EvalWords
from privacy.secagg.params import CLASSIC, MERGED
from privacy.secagg.quantize import LOSS_RANGE, StatWords, max_level
from server.compression import RoundPattern
from server.grid_io import collect, push
from server.secagg_config import SecAggScenarioConfig
from server.secure_outcome import SecureRoundOutcome, with_refusals
from server.settle import unreachable

if TYPE_CHECKING:
    from server.dp import DPController

STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)
MALICIOUS_STAGES = (*STAGES[:3], Stage.CONSISTENCY_CHECK, Stage.UNMASKING)


def stage_name(stage: Stage) -> str:
    return stage.name.lower()


def session_id(run_id: str) -> int:
    """The 63-bit SecAgg+ protocol run id of a store run id (bound into every protocol
    message of its training sessions). Not ``server.compression.session_number``: that
    number hashes the run id under its own label, so the two differ for every run."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "little") >> 1


def _query(node: int, record: ConfigRecord, group: str) -> Message:
    """A ``query.secagg`` message carrying ``record``."""
    content = RecordDict({SecAggRecord.PROTOCOL: record})
    return Message(content, node, f"query.{SecAggAction.SECAGG}", group_id=group)


@dataclass(frozen=True)
class TrainStart:
    """A training session: the first message is ``train.secagg`` with the model and the
    train config; each client trains, then masks its clipped delta (``dim`` coordinates,
    or only ``sparse``'s, a shared top-k pattern)."""

    arrays: ArrayRecord
    config: ConfigRecord
    dim: int
    sparse: RoundPattern | None = None
    group_prefix: ClassVar[str] = ""

    def message(self, node: int, record: ConfigRecord, group: str) -> Message:
        content = RecordDict({"arrays": self.arrays, "config": self.config,
                              SecAggRecord.PROTOCOL: record})
        return Message(content, node, f"train.{SecAggAction.SECAGG}", group_id=group)


@dataclass(frozen=True)
class HeldStart:
    """Secure FedBuff: the nodes already hold their trained deltas. The first message is
    ``query.secagg`` with SETUP and the node's staleness factor s(tau) (``factors``), no
    model; the sum decodes to sum(w_i * s(tau_i) * clip(delta_i))."""

    factors: dict[int, float]
    dim: int
    sparse: RoundPattern | None = None
    group_prefix: ClassVar[str] = ""

    def message(self, node: int, record: ConfigRecord, group: str) -> Message:
        record[SecAggKey.FACTOR] = float(self.factors[node])
        return _query(node, record, group)


@dataclass(frozen=True)
class EvalStart:
    """A secure evaluation: the first message is ``evaluate.secagg`` with the model and
    an evaluate config; each client's vector is its evaluation totals in the ``words``
    layout, and the outcome's ``evaluation`` holds the survivors' decoded totals (no
    model sum, no clip range, no DP, no compression)."""

    arrays: ArrayRecord
    config: ConfigRecord
    words: EvalWords
    group_prefix: ClassVar[str] = "eval-"

    def message(self, node: int, record: ConfigRecord, group: str) -> Message:
        content = RecordDict({"arrays": self.arrays, "config": self.config,
                              SecAggRecord.PROTOCOL: record})
        return Message(content, node, f"evaluate.{SecAggAction.SECAGG}", group_id=group)


#: How a session's first message differs: training, held updates or evaluation.
Start = TrainStart | HeldStart | EvalStart

#: Runs the masked-input stage instead of the Grid: (session, FORWARDED_SHARES by node).
MaskedInputStage = Callable[[SecAggServer, dict[int, bytes]], None]


def _first_line(text: str, limit: int = 300) -> str:
    return text.strip().splitlines()[0][:limit] if text.strip() else "client error"


def _payload(reply: Message) -> bytes:
    return protocol_payload(reply.content)  # type: ignore[return-value]


def _push_and_collect(grid: Grid, messages: list[Message], *, timeout: float, poll: float,
                      on_reply: Callable[[int, Message], None]) -> None:
    """Push, then hand each reply to ``on_reply(node, reply)`` until all came or time is up."""
    node_of = push(grid, messages)
    collect(grid, node_of, timeout=timeout, poll=poll,
            on_reply=lambda msg_id, reply: on_reply(node_of[msg_id], reply))


@dataclass(frozen=True)
class SecAggSession:
    """SecAgg+ sessions over ``grid`` with one round's ``settings`` (its clip range fixed:
    ``server.secure_range``), the run's ``weight_by``, protocol run id ``protocol_id``
    (:func:`session_id`), each stage's deadline ``timeout`` and ``poll``, and ``dp``.

    With ``dp`` in central mode the clients clip to ``dp.clip``; in distributed mode
    (``dp.plan`` set) they add integer noise and the outcome's ``weighted_sum`` is the
    noisy sum of the clipped deltas, ``total_weight`` the number of survivors; no stat
    words then. Each client's vector otherwise ends with its stat words (values clipped,
    examples, loss), whose totals the outcome keeps.
    """

    grid: Grid
    settings: SecAggScenarioConfig
    weight_by: str
    protocol_id: int
    timeout: float
    poll: float
    dp: DPController | None = None

    def run(self, nodes: list[int], rnd: int, start: Start, *,
            on_reply: Callable[[int], None] | None = None,
            masked_input: MaskedInputStage | None = None,
            pending: PendingAdverts | None = None) -> SecureRoundOutcome:
        """Run the SecAgg+ stages with ``nodes`` for round ``rnd``, the first message as
        ``start`` says; the decoded weighted sum (or evaluation totals), or an abort.

        ``on_reply(i)`` is called as the i-th answer to the first message comes. With
        ``masked_input`` the masked-input stage runs elsewhere: it gets the session and
        the FORWARDED_SHARES messages and hands the session the sum of the masked vectors
        (``SecAggServer.receive_sum``; cross-silo rounds sum them over a ring). ``pending``:
        the run's keys advertised ahead (a training round of the merged flow with
        ``settings.advertise_ahead`` takes this round's and adds the next round's).
        """
        settings, weight_by, dp = self.settings, self.weight_by, self.dp
        evaluation = start.words if isinstance(start, EvalStart) else None
        sparse = None if isinstance(start, EvalStart) else start.sparse
        dim = 0 if isinstance(start, EvalStart) else start.dim
        if evaluation is not None and dp is not None:
            raise ValueError("a secure evaluation takes no DP, compression or held updates")
        participants = sorted(int(n) for n in nodes)
        outcome = SecureRoundOutcome(status="aborted", participants=participants, round=rnd,
                                     security=settings.security)
        plan: DistributedDPPlan | None = None
        try:
            k, t = settings.graph(len(participants))
            if dp is not None and dp.plan is not None:
                if sparse is not None:
                    raise ValueError("a shared top-k pattern does not combine with "
                                     "distributed DP")
                plan = dp.plan.for_clients(len(participants))
            scale = 0.0 if plan is not None or evaluation is not None \
                else settings.scale_for(len(participants), weight_by)
        except ValueError as exc:
            outcome.abort_reason = str(exc)
            return outcome
        cap = settings.weight_cap(weight_by)
        outcome.k, outcome.t, outcome.scale = k, t, scale
        sent = sparse.indices.size if sparse is not None else dim  # coordinates under the masks
        stats = None if plan is not None or evaluation is not None else StatWords(
            sent, max_level(settings.start_range, scale, cap), float(settings.max_weight))
        if evaluation is not None:
            words, sent = evaluation.words, 0
        else:
            words = plan.padded_dim if stats is None else sent + 1 + stats.words
        outcome.coordinates = sent
        outcome.clip_range = 0.0 if stats is None else settings.start_range
        ahead = (pending is not None and isinstance(start, TrainStart)
                 and masked_input is None and settings.advertise_ahead)
        given = pending.take(self.protocol_id, rnd, participants) \
            if ahead and pending is not None else None
        server = SecAggServer(SessionParams.create(participants, words, bits=settings.bits,
                                                   k=k, t=t, run_id=self.protocol_id,
                                                   round_id=rnd, security=settings.security,
                                                   flow=MERGED if masked_input is None
                                                   else CLASSIC, keys_ahead=given is not None,
                                                   advertise_ahead=ahead,
                                                   presign=settings.presign),
                              settings.policy, None, given)
        exchanges = [0]  # the session's exchanges so far
        malicious = server.config.malicious
        common = {SecAggKey.RUN: self.protocol_id, SecAggKey.ROUND: rnd,
                  SecAggKey.DROPOUT: settings.dropout,
                  SecAggKey.DROPOUT_STAGE: settings.dropout_stage}
        setup = ConfigRecord({**common, SecAggKey.SCALE: scale,
                              SecAggKey.CLIP: settings.start_range, SecAggKey.MAX_WEIGHT: cap,
                              SecAggKey.WEIGHT_BY: weight_by,
                              SecAggKey.ROUNDING: settings.rounding})
        rotation_seed = secrets.randbits(63) if plan is not None else 0  # public, fresh per round
        if evaluation is not None:  # the evaluation words' layout, nothing of a model's
            setup = ConfigRecord({**common, **eval_setup(evaluation)})
        elif plan is not None:
            setup[SecAggKey.DP_PLAN] = json.dumps({**plan.to_dict(),
                                                   SecAggKey.ROTATION_SEED: rotation_seed})
        else:  # the stat words' bounds
            setup[SecAggKey.MAX_EXAMPLES] = float(settings.max_weight)
            setup[SecAggKey.LOSS_RANGE] = LOSS_RANGE
            if dp is not None and dp.config.mode == "central":
                setup[SecAggKey.DP_CLIP] = float(dp.clip)
        if sparse is not None:
            setup[ConfigKey.COMPRESSION] = sparse.request
        group = f"{start.group_prefix}{rnd}"

        def first(node: int, payload: bytes) -> Message:
            return start.message(node, ConfigRecord({**setup, SecAggKey.MSG: payload}), group)

        def later(node: int, payload: bytes) -> Message:
            return _query(node, ConfigRecord({SecAggKey.MSG: payload}), group)

        def receive(node: int, reply: Message) -> None:
            if exchanges[0] == 1:  # the first (training) exchange
                outcome.replies += 1
                if on_reply is not None:
                    on_reply(outcome.replies)
            if reply.has_error():  # a dropout of the stage: the SuperLink's word, or the client's
                outcome.errors[node] = unreachable(reply, node) or _first_line(reply.error.reason)
                return
            payload = _payload(reply)
            if not payload:
                outcome.errors[node] = "reply without a secure-aggregation payload"
            server.receive(node, payload)

        outbox, make = server.start(), first
        while server.status is Status.RUNNING:
            stage, started = server.stage, time.perf_counter()
            exchanges[0] += 1
            if stage is Stage.MASKED_INPUT and masked_input is not None:
                masked_input(server, outbox)
            else:
                messages = [make(node, payload) for node, payload in outbox.items()]
                _push_and_collect(self.grid, messages, timeout=self.timeout, poll=self.poll,
                                  on_reply=receive)
            named = Stage.ADVERTISE_KEYS if make is first else stage  # the training stage
            outbox, make = server.advance(), later
            outcome.stage_seconds[stage_name(named)] = time.perf_counter() - started
            # the stage after masking: the consistency check, or the unmask request (the
            # semi-honest mode, or a pre-signed round)
            reveal = (Stage.CONSISTENCY_CHECK, Stage.UNMASKING) if malicious \
                else (Stage.UNMASKING,)
            masked = stage in (Stage.SHARE_KEYS, Stage.MASKED_INPUT)  # merged flow: SHARE_KEYS
            if plan is not None and server.stage in reveal and masked \
                    and server.status is Status.RUNNING:
                assert dp is not None
                stop = _over_budget(dp, plan, len(server.survivors), len(participants))
                if stop:
                    outcome.abort_reason = stop
                    break
        if ahead and pending is not None:
            pending.offer(server.ahead)
        stages = MALICIOUS_STAGES if malicious else STAGES
        outcome.dropouts = {stage_name(s): sorted(server.dropouts.get(s, ())) for s in stages}
        outcome.rejected = dict(sorted(server.rejected.items()))
        outcome.excluded = dict(sorted(server.excluded.items()))
        outcome.survivors = sorted(server.survivors)
        outcome.server_seconds = {stage_name(s): v for s, v in server.seconds.items()}
        outcome.server_cpu_seconds = {stage_name(s): v for s, v in server.cpu_seconds.items()}
        if server.status is not Status.COMPLETED:
            outcome.abort_reason = outcome.abort_reason or with_refusals(
                server.abort_reason, outcome.errors)
            return outcome
        if evaluation is not None:
            total, weight = None, 0.0
            try:
                outcome.evaluation = evaluation.decode(server.result())
            except ValueError as exc:  # pragma: no cover - the server checked the length
                outcome.abort_reason = f"secure evaluation: {exc}"
                return outcome
        elif plan is not None:
            total = distributed_decode(server.result(), plan, rotation_seed).astype(np.float64)
            weight = float(len(outcome.survivors))
            outcome.noise_multiplier = plan.noise_multiplier_with(len(outcome.survivors))
        else:
            assert stats is not None
            result = server.result()
            outcome.clipped, outcome.examples, outcome.loss_sum = stats.decode(result[sent + 1:])
            total, weight = dequantize_weighted(result[:sent + 1], len(outcome.survivors),
                                                clip_range=settings.start_range, scale=scale,
                                                max_weight=cap)
            if sparse is not None:
                total = sparse.scatter(total, dim)
        outcome.status = "completed"
        alive = set(outcome.survivors)
        outcome.masks_removed = len(alive) + sum(
            len(server.neighbours[v] & alive) for v in server.dropouts.get(Stage.MASKED_INPUT, ()))
        outcome.weighted_sum = total
        outcome.total_weight = weight
        return outcome


def _over_budget(dp: DPController, plan: DistributedDPPlan, survivors: int,
                 participants: int) -> str | None:
    """Why the noisy sum of ``survivors`` clients must not be revealed, or None."""
    after = dp.release_exceeds_budget(plan.noise_multiplier_with(survivors))
    if after is None:
        return None
    return (f"distributed DP: with {survivors} of {participants} clients' noise in the sum, "
            f"revealing it would bring epsilon to {after:.4g} > dp.epsilon_budget "
            f"{dp.config.epsilon_budget:g}; no share was requested")
