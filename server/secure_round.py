"""A secure round: the SecAgg+ stages over a Flower Grid; the server learns only a sum.

Message flow (client side in ``client.secure_client``), one push/pull per stage, each
with the deadline ``federation.round_timeout_s``:

    train.secagg  model + SETUP          -> ADVERTISE_KEYS   (the client trains first)
    query.secagg  PUBLIC_KEYS            -> SHARE_KEYS
    query.secagg  FORWARDED_SHARES       -> MASKED_INPUT     (uint8 ArrayRecord)
    query.secagg  UNMASK_REQUEST         -> UNMASK_RESPONSE

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

A secure evaluation (``server.secure_evaluation``) runs the same stages with an
``evaluation`` layout: the first message is ``evaluate.secagg`` (the model, an evaluate
config and SETUP), each client's vector holds only its evaluation totals
(``privacy.secagg.eval_words``), and the session decodes their sums.

Top-k on a shared pattern (``server.compression.SharedPattern``): the SETUP record also
carries the compression request, the clients mask only the round's ``k`` coordinates
plus the weight (SecAgg+ vectors of ``k + 1`` words), and the unmasked sum is scattered
back into the model's ``d`` coordinates before the server optimizer. Each round records
its bytes on the wire (``server.wire_bytes``) in its metrics.

Differential privacy (``server.dp``): with central DP each client clips its delta below
the clip norm C by the rounding's worst case, so its decoded contribution stays within C
(:func:`central_dp_clip` refuses at start a scale that would leave clients less than half
of C), and the pipeline noises the decoded sum and divides by the expected (public) number
of clients per round, however many survive; with distributed DP each client sends
its clipped, rotated, scaled and rounded delta plus its share of integer noise (the
round's plan travels in the SETUP record), the server decodes the noisy sum, and before
asking for any unmasking share it checks that the survivors' noise keeps the run within
its epsilon budget (else it aborts: the sum is never revealed).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from client.protocol.keys import ConfigKey
from client.protocol.secagg import SecAggAction, SecAggKey, SecAggRecord, eval_setup
from privacy.dp import DistributedDPPlan, distributed_decode
from privacy.secagg import SecAggConfig, SecAggServer, Stage, Status, dequantize_weighted
from privacy.secagg.eval_words import EvalWords
from privacy.secagg.quantize import (
    LOSS_RANGE,
    StatWords,
    contribution_clip,
    decode_error_l2,
    max_level,
)
from server.compression import RoundPattern, SharedPattern
from server.grid_io import collect, push
from server.rounds import RoundResult, RunContext
from server.secagg_config import SecAggScenarioConfig
from server.secure_outcome import SecureRoundOutcome
from server.secure_range import ClipRange
from server.settle import unreachable
from server.store import UpdateRecord
from server.sync_rounds import Collector

if TYPE_CHECKING:
    from server.dp import DPController
    from server.reporter import Reporter
    from server.scenario import ServerScenario

STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)


def stage_name(stage: Stage) -> str:
    return stage.name.lower()


def session_id(run_id: str) -> int:
    """The 63-bit SecAgg+ protocol run id of a store run id (bound into every protocol
    message of its training sessions). Not ``server.compression.session_number``: that
    number hashes the run id under its own label, so the two differ for every run."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "little") >> 1


def _first_line(text: str, limit: int = 300) -> str:
    return text.strip().splitlines()[0][:limit] if text.strip() else "client error"


def _payload(reply: Message) -> bytes:
    content = reply.content
    vector = content.get(SecAggRecord.VECTOR)
    if isinstance(vector, ArrayRecord) and SecAggKey.VECTOR in vector:
        return vector[SecAggKey.VECTOR].data
    record = content.get(SecAggRecord.PROTOCOL)
    value = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
    return value if isinstance(value, bytes) else b""


def _push_and_collect(grid: Grid, messages: list[Message], *, timeout: float, poll: float,
                      on_reply: Callable[[int, Message], None]) -> None:
    """Push, then hand each reply to ``on_reply(node, reply)`` until all came or time is up."""
    node_of = push(grid, messages)
    collect(grid, node_of, timeout=timeout, poll=poll,
            on_reply=lambda msg_id, reply: on_reply(node_of[msg_id], reply))


#: Runs the masked-input stage instead of the Grid: (session, FORWARDED_SHARES by node).
MaskedInputStage = Callable[[SecAggServer, dict[int, bytes]], None]


def secure_round(grid: Grid, *, nodes: list[int], arrays: ArrayRecord | None,
                 config: ConfigRecord | None, settings: SecAggScenarioConfig, weight_by: str,
                 dim: int, session: int, rnd: int, timeout: float, poll: float,
                 on_reply: Callable[[int], None] | None = None,
                 held: dict[int, float] | None = None,
                 dp: DPController | None = None,
                 sparse: RoundPattern | None = None,
                 masked_input: MaskedInputStage | None = None,
                 evaluation: EvalWords | None = None) -> SecureRoundOutcome:
    """Run the SecAgg+ stages with ``nodes``; the decoded weighted sum, or an abort.

    With ``held`` (secure FedBuff: node -> staleness factor s(tau)) the nodes already hold
    their trained deltas: the first message is ``query.secagg`` with SETUP and the factor,
    without a model, and the sum decodes to sum(w_i * s(tau_i) * clip(delta_i)).

    ``settings.clip_range`` is the round's (a number: ``server.secure_range``); each
    client's vector ends with its stat words (values clipped, examples, loss), whose
    totals the outcome keeps.

    With ``dp`` in central mode the clients clip to ``dp.clip``; in distributed mode
    (``dp.plan`` set) they add integer noise and the outcome's ``weighted_sum`` is the
    noisy sum of the clipped deltas, ``total_weight`` the number of survivors; no stat
    words then.

    With ``sparse`` (top-k on a shared pattern) the clients mask only the pattern's ``k``
    coordinates plus the weight; the unmasked sum is scattered back into ``dim``.

    With ``masked_input`` the masked-input stage runs elsewhere: it gets the session and
    the FORWARDED_SHARES messages and hands the session the sum of the masked vectors
    (``SecAggServer.receive_sum``; cross-silo rounds sum them over a ring).

    With ``evaluation`` (a secure evaluation session) the first message is
    ``evaluate.secagg`` with ``arrays`` and ``config`` (an evaluate config), each client's
    vector is its evaluation words in that layout, and the outcome's ``evaluation`` holds
    the survivors' decoded totals; no model sum, no clip range, no DP, no compression.
    """
    if evaluation is not None and (dp is not None or sparse is not None or held is not None):
        raise ValueError("a secure evaluation takes no DP, compression or held updates")
    participants = sorted(int(n) for n in nodes)
    outcome = SecureRoundOutcome(status="aborted", participants=participants, round=rnd)
    plan: DistributedDPPlan | None = None
    try:
        k, t = settings.graph(len(participants))
        if dp is not None and dp.plan is not None:
            if sparse is not None:
                raise ValueError("a shared top-k pattern does not combine with distributed DP")
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
    server = SecAggServer(SecAggConfig.create(participants, words, bits=settings.bits, k=k,
                                              t=t, run_id=session, round_id=rnd),
                          settings.policy)
    common = {SecAggKey.RUN: session, SecAggKey.ROUND: rnd, SecAggKey.DROPOUT: settings.dropout,
              SecAggKey.DROPOUT_STAGE: settings.dropout_stage}
    setup = ConfigRecord({**common, SecAggKey.SCALE: scale,
                          SecAggKey.CLIP: settings.start_range, SecAggKey.MAX_WEIGHT: cap,
                          SecAggKey.WEIGHT_BY: weight_by, SecAggKey.ROUNDING: settings.rounding})
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
    group, action = (f"eval-{rnd}", "evaluate") if evaluation is not None else (str(rnd), "train")

    def first(node: int, payload: bytes) -> Message:
        record = ConfigRecord({**setup, SecAggKey.MSG: payload})
        if held is not None:  # secure FedBuff: the node weights the delta it holds
            record[SecAggKey.FACTOR] = float(held[node])
            return later(node, b"", record)
        content = RecordDict({"arrays": arrays, "config": config, SecAggRecord.PROTOCOL: record})
        return Message(content, node, f"{action}.{SecAggAction.SECAGG}", group_id=group)

    def later(node: int, payload: bytes, record: ConfigRecord | None = None) -> Message:
        record = record or ConfigRecord({SecAggKey.MSG: payload})
        content = RecordDict({SecAggRecord.PROTOCOL: record})
        return Message(content, node, f"query.{SecAggAction.SECAGG}", group_id=group)

    def receive(node: int, reply: Message) -> None:
        if server.stage is Stage.ADVERTISE_KEYS:
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
        if stage is Stage.MASKED_INPUT and masked_input is not None:
            masked_input(server, outbox)
        else:
            messages = [make(node, payload) for node, payload in outbox.items()]
            _push_and_collect(grid, messages, timeout=timeout, poll=poll, on_reply=receive)
        outbox, make = server.advance(), later
        outcome.stage_seconds[stage_name(stage)] = time.perf_counter() - started
        if plan is not None and server.stage is Stage.UNMASKING and \
                server.status is Status.RUNNING:
            stop = _over_budget(dp, plan, len(server.survivors), len(participants))
            if stop:
                outcome.abort_reason = stop
                break
    outcome.dropouts = {stage_name(s): sorted(server.dropouts.get(s, ())) for s in STAGES}
    outcome.rejected = dict(sorted(server.rejected.items()))
    outcome.excluded = dict(sorted(server.excluded.items()))
    outcome.survivors = sorted(server.survivors)
    outcome.server_seconds = {stage_name(s): v for s, v in server.seconds.items()}
    outcome.server_cpu_seconds = {stage_name(s): v for s, v in server.cpu_seconds.items()}
    if server.status is not Status.COMPLETED:
        outcome.abort_reason = outcome.abort_reason or server.abort_reason
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


MIN_CLIP_SHARE = 0.5  # central DP under secagg: the clip clients keep, as a share of dp.clip


def central_dp_clip(settings: SecAggScenarioConfig, *, clip: float, dim: int, clients: int,
                    weight_by: str, qsgd: bool = False) -> float:
    """Central DP under secure aggregation: the L2 norm each client of a round of up to
    ``clients`` clips its ``dim`` masked coordinates to, so that its decoded contribution,
    rounding included, stays within ``clip`` (``privacy.secagg.quantize.contribution_clip``).

    ValueError, naming the key to change, when the rounding's worst case would leave less
    than :data:`MIN_CLIP_SHARE` of ``clip`` (``qsgd``: secure QSGD, whose modulus
    ``compression.bits`` sets). The largest round has the coarsest scale, so it decides.
    """
    cap = settings.weight_cap(weight_by)

    def at(bits: int) -> tuple[float, float, float]:
        """(scale, rounding margin, clip kept) with a 2^bits modulus."""
        cfg = replace(settings, bits=bits)
        scale = cfg.scale_for(clients, weight_by)
        level = max_level(cfg.start_range, scale, cap)
        margin = decode_error_l2(dim, scale, cfg.rounding, level)  # type: ignore[arg-type]
        return scale, margin, contribution_clip(clip, dim=dim, scale=scale,
                                                rounding=cfg.rounding,  # type: ignore[arg-type]
                                                level=level)

    def enough(bits: int) -> bool:
        try:
            return at(bits)[2] >= MIN_CLIP_SHARE * clip
        except ValueError:  # the sum cannot fit at that modulus
            return False

    scale, margin, kept = at(settings.bits)
    if kept >= MIN_CLIP_SHARE * clip:
        return kept
    what = (f"central DP under secure aggregation: rounding {dim} coordinates at scale "
            f"{scale:g} (secagg.bits = {settings.bits}, {clients} clients per sum, "
            f"{settings.rounding} rounding) can move a client's decoded update by {margin:.3g} "
            f"in L2, so clients would clip to {max(kept, 0.0):.3g}, less than "
            f"{MIN_CLIP_SHARE:g} of dp.clip = {clip:g}")
    need = next((b for b in range(settings.bits + 1, 65) if enough(b)), None)
    if settings.scale > 0:
        fix = "raise secagg.scale (and secagg.bits to fit it) or set secagg.scale = 0"
    elif need is None:
        fix = "no modulus up to 2^64 is enough"
    elif qsgd:  # the resolved modulus is the smallest whose levels reach 2^compression.bits
        levels = max_level(settings.start_range, at(need - 1)[0], cap).bit_length()
        fix = (f"raise compression.bits to >= {levels} (secure QSGD sets secagg.bits from "
               f"it; a {need}-bit modulus is needed)" if levels <= 16 else
               f"secure QSGD cannot (compression.bits <= 16): set compression.kind = 'none' "
               f"and secagg.bits >= {need}")
    else:
        fix = f"raise secagg.bits to >= {need}"
    raise ValueError(f"{what}: {fix}, or raise dp.clip above {2 * margin:.3g}")


class SecureSettings:
    """A run's secure aggregation (``[secagg] enabled``): its settings, start-up checks and
    how a decoded sum becomes the aggregate the pipeline takes — one place for the sync,
    secure FedBuff and cross-silo rounds."""

    def __init__(self, settings: SecAggScenarioConfig, *, combine: str, weight_by: str,
                 max_clients: int = 0, sparse: SharedPattern | None = None,
                 qsgd: bool = False) -> None:
        self.settings = settings
        self.qsgd = qsgd  # secure QSGD: compression.bits sets secagg.bits
        self.sparse = sparse  # top-k on a shared pattern, or None (dense)
        self.combine = combine
        self.weight_by = weight_by
        self.max_clients = max_clients  # the most participants a round can have
        self.range = ClipRange(settings, qsgd=qsgd)  # each round's clip range

    def round_settings(self, dp: DPController | None) -> SecAggScenarioConfig:
        """The next round's settings, its clip range fixed (``server.secure_range``)."""
        central = dp is not None and dp.config.mode == "central"
        return self.range.for_round(float(dp.clip) if central and dp is not None else None)

    def prepare(self, ctx: RunContext) -> None:
        """At the start of a run: plan distributed DP for the model and ``[secagg] bits``
        (ValueError, naming the key, when the noisy sum could wrap); for central DP check
        that rounding leaves clients enough of the clip (:func:`central_dp_clip`)."""
        dp, dim = ctx.dp, ctx.layout.dim
        if dp is not None and dp.config.mode == "central":
            central_dp_clip(self.round_settings(dp), clip=dp.clip, clients=max(2, self.max_clients),
                            dim=self.sparse.config.k_for(dim) if self.sparse else dim,
                            weight_by=self.weight_by, qsgd=self.qsgd)
        if dp is not None and dp.config.mode == "distributed" and dp.plan is None:
            dp.plan_distributed(dim=dim, bits=self.settings.bits, max_clients=self.max_clients)

    def pattern(self, run_id: str, rnd: int, dim: int) -> RoundPattern | None:
        """Round ``rnd``'s shared top-k pattern, or None when the rounds are dense."""
        return self.sparse.for_round(run_id, rnd, dim) if self.sparse is not None else None

    def aggregate(self, outcome: SecureRoundOutcome, dp: DPController | None,
                  weight: float | None = None,
                  reporter: Reporter | None = None) -> np.ndarray | None:
        """The decoded sum as the pipeline takes it (None: nothing to apply): the mean (or
        the sum, ``combine = "sum"``) over ``weight`` (default the sum's weight); central
        DP: the sum (the pipeline noises it and divides by the public count); distributed
        DP: the noisy sum over the expected count, a number that does not depend on data.
        The next round's clip range follows from the outcome; the run's first round
        whose clients clipped warns (logged, and to ``reporter``)."""
        self.range.observe(outcome, reporter)
        if outcome.weighted_sum is None or outcome.total_weight <= 0:
            return None
        divisor = 1.0 if self.combine == "sum" else (weight or outcome.total_weight)
        if dp is not None:
            divisor = 1.0 if dp.config.mode == "central" else float(dp.clients_per_round)
        return (outcome.weighted_sum / divisor).astype(np.float32)


class SecureSum(Collector):
    """A synchronous round's SecAgg+ session: the server learns only the cohort's sum."""

    def __init__(self, ctx: RunContext, secure: SecureSettings) -> None:
        self.ctx = ctx
        self.secure = secure

    @contextmanager
    def session(self) -> Iterator[None]:
        self.secure.prepare(self.ctx)
        yield

    def collect(self, run_id: str, rnd: int, cohort: list[int]) -> RoundResult:
        ctx, secure = self.ctx, self.secure
        outcome = secure_round(
            ctx.grid, nodes=cohort, arrays=ctx.model_record(), config=ctx.train_config(rnd),
            settings=secure.round_settings(ctx.dp), weight_by=secure.weight_by,
            dim=ctx.layout.dim,
            session=session_id(run_id), rnd=rnd, timeout=ctx.fed.round_timeout_s,
            poll=ctx.fed.poll_s, on_reply=lambda i: ctx.reporter.client_done(rnd, i, len(cohort)),
            dp=ctx.dp, sparse=secure.pattern(run_id, rnd, ctx.layout.dim))
        clock = ctx.clock
        if clock.simulated:  # the slowest participant's training
            clock.advance_to(max([clock.outcome(n).end for n in cohort] or [clock.now()]))
        return secure_result(outcome, secure.aggregate(outcome, ctx.dp, reporter=ctx.reporter),
                             num_sampled=len(cohort), metrics={})


def secure_result(outcome: SecureRoundOutcome, aggregate: np.ndarray | None, *,
                  num_sampled: int, metrics: dict[str, float],
                  records: list[UpdateRecord] | None = None,
                  status: str | None = None, what: str = "secure aggregation") -> RoundResult:
    """The ``RoundResult`` of a secure session whose aggregate is ``aggregate``, with the
    figures decoded from its sum (:meth:`SecureRoundOutcome.metrics`) among its metrics."""
    metrics = {**outcome.metrics(), **metrics}
    applied = aggregate is not None
    status = status or ("completed" if applied else
                        "aborted" if outcome.status == "aborted" else "failed")
    return RoundResult(aggregate=aggregate, status=status,
                       records=records if records is not None else outcome.update_records(),
                       num_sampled=num_sampled, num_replies=outcome.replies,
                       total_weight=outcome.total_weight, count=len(outcome.survivors),
                       metrics=metrics, noise_multiplier=outcome.noise_multiplier,
                       secure=outcome,
                       note=f"{what} {status}: {outcome.abort_reason or 'no weight'}")


def make_secure_settings(scenario: ServerScenario) -> SecureSettings | None:
    """The secure aggregation of a resolved scenario (checked by
    ``server.settings_checks``), or None when secagg is off."""
    from server.secagg_config import max_round_size

    if not scenario.secagg.enabled:
        return None
    agg, compression = scenario.aggregation, scenario.compression
    return SecureSettings(scenario.secagg, combine=agg.combine, weight_by=agg.weight_by,
                          max_clients=max_round_size(scenario.raw),
                          sparse=SharedPattern.of(compression, secure=True),
                          qsgd=compression.enabled and compression.kind == "qsgd")
