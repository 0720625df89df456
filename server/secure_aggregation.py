"""A run's secure aggregation (``[secagg] enabled``): its settings, start-up checks and how
a decoded sum becomes the aggregate the pipeline takes, for the sync, secure FedBuff and
cross-silo rounds alike. One round's SecAgg+ session is ``server.secagg_session``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from privacy.secagg.quantize import contribution_clip, decode_error_l2, max_level
from server.compression import RoundPattern, SharedPattern
from server.rounds import RoundResult, RunContext
from server.secagg_config import SecAggScenarioConfig, max_round_size
from server.secagg_session import SecAggSession, session_id
from server.secure_outcome import SecureRoundOutcome
from server.secure_range import ClipRange
from server.store import UpdateRecord

if TYPE_CHECKING:
    from server.dp import DPController
    from server.reporter import Reporter
    from server.scenario import ServerScenario

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


class SecureAggregation:
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

    def session(self, ctx: RunContext, run_id: str, *, dp: DPController | None,
                timeout: float) -> SecAggSession:
        """The SecAgg+ session of run ``run_id``'s next round over ``ctx.grid``: the
        round's settings (:meth:`round_settings`), stages of at most ``timeout`` s."""
        return SecAggSession(ctx.grid, self.round_settings(dp), self.weight_by,
                             session_id(run_id), timeout, ctx.fed.poll_s, dp)

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
                       session=outcome,
                       note=f"{what} {status}: {outcome.abort_reason or 'no weight'}")


def make_secure_aggregation(scenario: ServerScenario) -> SecureAggregation | None:
    """The secure aggregation of a resolved scenario (checked by
    ``server.settings_checks``), or None when secagg is off."""
    if not scenario.secagg.enabled:
        return None
    agg, compression = scenario.aggregation, scenario.compression
    return SecureAggregation(scenario.secagg, combine=agg.combine, weight_by=agg.weight_by,
                             max_clients=max_round_size(scenario.raw),
                             sparse=SharedPattern.of(compression, secure=True),
                             qsgd=compression.enabled and compression.kind == "qsgd")
