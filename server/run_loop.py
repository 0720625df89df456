"""The one run loop: rounds from a source, each finished in one place.

Every kind of round (plain replies, a SecAgg+ sum, a FedBuff buffer, a ring sum across
silos) is a ``server.rounds.RoundSource`` that returns a ``RoundResult`` (with the
protocol session it ran, if any: a ``server.rounds.RoundSession``, which the loop stores
and shows without knowing its protocol);
:meth:`RunLoop.finish_round` then applies it through the pipeline's post stages and server
optimizer, bumps the model version, evaluates, charges the privacy accountant, records
the round and every update's fate, checkpoints and reports — the same steps for all.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from server.federated_eval import FederatedEvaluation
from server.rounds import RoundResult, RoundSource, RunContext
from server.spread import ACCURACY, accuracy_key, spread
from server.spread import PREFIX as FEDERATED
from server.store import EvalRecord

if TYPE_CHECKING:
    from server.audit import CanaryAudit


class RunLoop:
    """Drives a run: rounds from ``source`` until the configured rounds, the privacy
    budget, the target accuracy or the source itself stops it."""

    def __init__(self, ctx: RunContext, source: RoundSource,
                 audit: CanaryAudit | None = None) -> None:
        self.ctx = ctx
        self.source = source
        self.audit = audit
        self.stop_reason: str | None = None
        self.failed = False  # stopped after federation.max_failed_rounds empty rounds
        self._checkpointed = -1  # the round of the last checkpoint this process saved
        self._failed_streak: list[str] = []  # why each of the last rounds applied nothing
        self._earlier_wall_s = 0.0  # a resumed run's rounds from before this process
        self.resumed_after: int | None = None
        # the clients' evaluations of the global model (sources without one make their own)
        self.federated = FederatedEvaluation(ctx) if source.central_model else None

    # ---- the run

    def run(self, run_id: str | None = None) -> dict[str, Any]:
        """Train for the configured rounds; returns the run summary."""
        ctx, state = self.ctx, self.ctx.state
        started = time.perf_counter()
        with self.source.session():
            if run_id is None:
                run_id = ctx.store.create_run(config=ctx.config, seed=ctx.seed,
                                              name=ctx.config.get("name"))
                self._record_initial(run_id)
            ctx.reporter.run_started(run_id, ctx.config)
            if ctx.dp is not None:
                ctx.reporter.privacy_figures({s.key: s.relation for s in ctx.dp.specs},
                                             {s.key: s.against for s in ctx.dp.specs})
            try:
                while state.round < ctx.fed.rounds and not self._should_stop():
                    rnd = state.round + 1
                    t0 = time.perf_counter()
                    self.finish_round(run_id, rnd, self.source.next_round(run_id, rnd), t0)
                self._checkpoint(run_id)  # the last round, however the run ended
                ctx.store.flush()  # the last checkpoint is written off the round's path
            except BaseException:
                ctx.store.finish_run(run_id, status="failed")
                raise
            summary = self._summary(run_id, time.perf_counter() - started)
            self._record_leftover(run_id)
            self.source.finish(run_id, summary)
        ctx.store.finish_run(run_id, status=summary["status"], summary=summary)
        ctx.reporter.run_finished(summary)
        return summary

    def resume(self, run_id: str) -> dict[str, Any]:
        """Continue ``run_id`` from its last checkpoint: model, version, pipeline and privacy
        state. Rounds recorded after that checkpoint are discarded and run again, so no round
        is lost or applied twice; sampling and client seeds derive from (seed, round), so the
        result equals an uninterrupted run's (up to DP noise, which is never replayable, and
        cohorts under DP without ``dp.reproducible_cohorts``, which are drawn in secret)."""
        ctx, state = self.ctx, self.ctx.state
        if not self.source.central_model:
            raise ValueError(f"run {run_id} cannot be resumed: its rounds ({ctx.driver_config.kind}"
                             ") keep each silo's model on the silo, not in a checkpoint")
        ckpt = ctx.store.load_checkpoint(run_id)
        if ckpt is None:
            raise ValueError(f"run {run_id} has no checkpoint to resume from (it needs "
                             "federation.checkpoint_every >= 1)")
        if ckpt.params.shape != state.params.shape:
            raise ValueError(f"run {run_id}'s checkpoint has {ckpt.params.size} parameters, "
                             f"the model has {state.params.size}")
        state.params = np.array(ckpt.params, dtype=np.float32)
        state.version = ckpt.model_version
        state.round = self._checkpointed = ckpt.round
        ctx.pipeline.load_state_dict(ckpt.state.get("pipeline", {}))
        if ctx.dp is not None:
            ctx.dp.load_state_dict(ckpt.state["dp"])
        kept = [r for r in ctx.store.rounds(run_id) if r.round <= ckpt.round]
        state.history = [r.metrics for r in kept]
        self._earlier_wall_s = sum(r.wall_s for r in kept)
        self.resumed_after = ckpt.round
        # every recorded update, also those the resumed run discards: their privacy is spent
        ctx.dp_sgd.restore(u for _, u in ctx.store.updates(run_id))
        ctx.store.reopen_run(run_id, after_round=ckpt.round)
        ctx.reporter.message(f"resuming run {run_id} after round {ckpt.round} "
                             f"(model version {ckpt.model_version})")
        return self.run(run_id)

    # ---- one place that finishes every round

    def finish_round(self, run_id: str, rnd: int, result: RoundResult,
                     t0: float) -> dict[str, float]:
        """Apply, version, evaluate, account, record, checkpoint and report round ``rnd``."""
        ctx, state = self.ctx, self.ctx.state
        central = self.source.central_model
        applied = result.aggregate is not None if central else result.status == "completed"
        if self.audit is not None:  # the canaries' size and the round's noise
            self.audit.observe_round(result)
        if central:
            kept = state.params[ctx.local_mask] if ctx.local_mask is not None else None
            state.params = ctx.pipeline.apply(state.params, result.aggregate,
                                              total_weight=result.total_weight,
                                              count=result.count)
            if kept is not None:  # FedBN: the clients keep these; the server's stay as they were
                state.params[ctx.local_mask] = kept
        if applied:  # without a central model: the rounds that changed the silos' models
            state.version += 1
        state.round = rnd
        metrics = ({k: float(v) for k, v in ctx.task.evaluate(state.params).items()}
                   if central else {})
        evaluations, figures = self._federated(run_id, rnd, result)
        if ctx.clock.simulated:
            metrics["sim_time_s"] = ctx.clock.now()
        metrics.update(result.metrics)
        metrics.update(figures)
        metrics.update(ctx.dp_sgd.observe(result.records))  # the clients' DP-SGD figures
        metrics.update(self.source.traffic(ctx.grid))  # bytes_up, bytes_down
        self._account_privacy(run_id, rnd, released=applied, metrics=metrics,
                              noise_multiplier=result.noise_multiplier)
        counts = result.counts()
        if not applied:
            why = result.note or _nothing_applied(counts)
            self._failed_streak.append(why + _first_reason(result))
            ctx.reporter.message(f"round {rnd}: {why}; the model is unchanged")
        else:
            self._failed_streak = []
        self._record(run_id, rnd, result, metrics, applied=applied,
                     wall_s=time.perf_counter() - t0, evaluations=evaluations)
        if result.session is not None:
            result.session.save(ctx.store, run_id, rnd)
        state.history.append(metrics)
        if ctx.fed.checkpoint_every and rnd % ctx.fed.checkpoint_every == 0:
            self._checkpoint(run_id)
        shown = {**metrics, **{k: float(v) for k, v in counts.items()}}
        if result.session is not None:  # the round's session, for the round's line
            shown.update(result.session.shown())
        ctx.reporter.round_finished(rnd, shown)
        return metrics

    def _record(self, run_id: str, rnd: int, result: RoundResult, metrics: dict[str, float],
                *, applied: bool, wall_s: float, evaluations: list[EvalRecord]) -> None:
        """Store round ``rnd`` and every update's fate (the only place a round is written)."""
        counts = result.counts()
        self.ctx.store.record_round(
            run_id, round=rnd, model_version=self.ctx.state.version, status=result.status,
            num_sampled=result.num_sampled, num_replies=result.num_replies,
            num_accepted=counts["accepted"] if applied else 0,
            num_rejected=counts["rejected"], num_dropped=counts["dropped"], metrics=metrics,
            wall_s=wall_s, updates=result.records, evaluations=evaluations)

    def _record_leftover(self, run_id: str) -> None:
        """What the source holds when the run ends (FedBuff: what arrived after its last
        applied buffer), stored as an aborted round after the last one. Nothing is applied
        or evaluated: its figures are the last round's but the clients' evaluation, with
        its own traffic; the summary and the checkpoint leave it out."""
        result = self.source.leftover()
        if result is None:
            return
        last = self.ctx.state.history[-1] if self.ctx.state.history else {}
        metrics = {k: v for k, v in last.items() if not k.startswith(f"{FEDERATED}_")}
        metrics.update(result.metrics)
        metrics.update(self.source.traffic(self.ctx.grid))
        self._record(run_id, self.ctx.state.round + 1, result, metrics, applied=False,
                     wall_s=0.0, evaluations=[])

    # ---- helpers

    def _checkpoint(self, run_id: str) -> None:
        """Save the model after the current round unless it is saved already (checkpoints
        on: every ``federation.checkpoint_every`` rounds and after the last round run, also
        when a target, a budget or failed rounds stopped the run early); written on the
        store's writer thread while the next round runs."""
        ctx, state = self.ctx, self.ctx.state
        if (not self.source.central_model or not ctx.fed.checkpoint_every
                or state.round in (0, self._checkpointed)):
            return
        ctx.store.save_checkpoint_in_background(
            run_id, round=state.round, model_version=state.version, params=state.params,
            state={"pipeline": ctx.pipeline.state_dict(),
                   "dp": ctx.dp.state_dict() if ctx.dp else {}})
        self._checkpointed = state.round

    def _federated(self, run_id: str, rnd: int,
                   result: RoundResult) -> tuple[list[EvalRecord], dict[str, float]]:
        """Round ``rnd``'s federated evaluation: the source's own (gossip's silos), else the
        clients' evaluation of the global model when it is due; each client's record and
        the round's figures, with ``federated_eval_s``, the seconds it took."""
        if result.evaluations:
            evaluations, figures = result.evaluations, spread(result.evaluations)
        elif self.federated is not None and self.federated.due(rnd):
            started = time.perf_counter()
            evaluations, figures = self.federated.evaluate(run_id, rnd)
            figures = {**figures, "federated_eval_s": time.perf_counter() - started}
        else:
            return [], {}
        if ACCURACY not in figures:
            fates = {fate: sum(e.fate == fate for e in evaluations)
                     for fate in ("rejected", "dropped")}
            self.ctx.reporter.message(
                f"round {rnd}: federated evaluation got no accepted answer ({fates['rejected']}"
                f" rejected, {fates['dropped']} dropped); no federated figures recorded")
        return evaluations, figures

    def _record_initial(self, run_id: str) -> None:
        """Round 0: the initial model's evaluation."""
        ctx = self.ctx
        metrics = {k: float(v) for k, v in ctx.task.evaluate(ctx.state.params).items()}
        ctx.store.record_round(run_id, round=0, model_version=ctx.state.version,
                               metrics=metrics, wall_s=0.0)
        ctx.state.history.append(metrics)

    def _account_privacy(self, run_id: str, rnd: int, *, released: bool,
                         metrics: dict[str, float], noise_multiplier: float | None) -> None:
        """Charge a round to the accountant and the stored ledger (no-op without DP)."""
        dp = self.ctx.dp
        if dp is None:
            return
        spent = dp.end_round(released=released, noise_multiplier=noise_multiplier)
        self.ctx.store.record_privacy(run_id, round=rnd, mode=dp.config.mode,
                                      accountant=dp.config.accountant,
                                      epsilon=spent.epsilon, delta=spent.delta,
                                      noise_multiplier=spent.noise_multiplier, clip=spent.clip,
                                      sampling_rate=spent.sampling_rate,
                                      epsilon_model=spent.epsilon_model,
                                      protects_against=spent.protects_against,
                                      relation=spent.relation,
                                      epsilon_replace_one=spent.epsilon_replace_one,
                                      relation_model=spent.relation_model)
        metrics.update(epsilon=spent.epsilon, clip=spent.clip)
        for key in ("epsilon_replace_one", "epsilon_model", "noise_to_signal"):
            if getattr(spent, key) is not None:
                metrics[key] = getattr(spent, key)
        if spent.hint is not None:  # central noise stayed above the mean clipped update
            self.ctx.reporter.message(spent.hint)

    def _should_stop(self) -> bool:
        """Stop before the next round: the privacy budget, the target, the source or too
        many consecutive rounds that applied nothing."""
        why = (self._over_budget() or self.ctx.dp_sgd.over_budget()
               or self.source.stop_reason() or self._too_many_failed())
        if why is not None:
            self.stop_reason = f"stopped before round {self.ctx.state.round + 1}: {why}"
            self.ctx.reporter.message(self.stop_reason)
            return True
        if self._target_reached() and self.ctx.state.round == 0:  # not a failed run
            self.stop_reason = ("stopped before round 1: the initial model already reaches "
                                "driver.target_accuracy")
            self.ctx.reporter.message(self.stop_reason)
        return self._target_reached()

    def _too_many_failed(self) -> str | None:
        limit = self.ctx.fed.max_failed_rounds
        if not limit or len(self._failed_streak) < limit:
            return None
        self.failed = True
        return (f"{len(self._failed_streak)} consecutive rounds applied no update "
                f"(federation.max_failed_rounds = {limit}); the last: {self._failed_streak[-1]}")

    def _over_budget(self) -> str | None:
        dp = self.ctx.dp
        after = dp.next_round_exceeds_budget() if dp is not None else None
        if after is None:
            return None
        return (f"{dp.budget.key} ({dp.budget.relation}) would reach {after:.4g} > "
                f"dp.epsilon_budget {dp.config.epsilon_budget:g} (spent "
                f"{dp.budget_epsilon():.4g})")

    def _target_reached(self) -> bool:
        target = self.ctx.driver_config.target_accuracy
        last = self.ctx.state.history[-1] if self.ctx.state.history else {}
        return target > 0 and last.get(self.ctx.driver_config.target_metric(), -1.0) >= target

    def _summary(self, run_id: str, wall_s: float) -> dict[str, Any]:
        ctx, state = self.ctx, self.ctx.state
        last = state.history[-1] if state.history else {}
        status = ("failed" if self.failed else "stopped" if self.stop_reason else
                  "completed" if state.version > 0 else "failed")
        summary: dict[str, Any] = {
            "run_id": run_id, "status": status, "rounds": state.round,
            "versions": state.version, "final_accuracy": last.get("accuracy"),
            "final_loss": last.get("loss"), "wall_s": round(wall_s, 3),
            "wall_s_total": round(self._earlier_wall_s + wall_s, 3),
            "store": ctx.store.display_url()}
        if self.resumed_after is not None:  # wall_s is this part's, wall_s_total the run's
            summary["resumed_after_round"] = self.resumed_after
        if ctx.dp is not None:
            summary.update(ctx.dp.summary())
        summary.update(ctx.dp_sgd.summary())  # DP-SGD's figure, largest over clients
        if self.audit is not None:  # the one-shot estimate from theta_T - theta_0
            initial, _ = ctx.task.initial_params()
            summary.update(self.audit.summary(state.params - initial))
            flagged = self.audit.warning(summary)
            if flagged is not None:
                ctx.reporter.message(flagged)
        summary.update(_federated_summary(state.history))
        if self.stop_reason:
            summary["stop_reason"] = self.stop_reason
        if ctx.grid.down:  # this process's traffic
            summary.update(ctx.grid.totals())
        summary["driver"] = ctx.driver_config.kind
        if ctx.clock.simulated:
            summary["simulated_time"] = round(ctx.clock.now(), 6)
        summary["reached_target"] = (self._target_reached()
                                     if ctx.driver_config.target_accuracy > 0 else None)
        return summary


def _federated_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """The federated figures of the last round that has them: the weighted mean, the 10th
    percentile and the minimum, of the clients' own models too where they were measured."""
    last = next((m for m in reversed(history) if ACCURACY in m), None)
    if last is None:
        return {}
    keys = [accuracy_key(stat, personal=personal) for personal in (False, True)
            for stat in (None, "p10", "min")]
    return {key: last[key] for key in keys if key in last}


def _nothing_applied(counts: dict[str, int]) -> str:
    """Why a round without a note applied nothing, from its updates' fates."""
    return (f"no update was applied ({counts['accepted']} accepted, {counts['rejected']} "
            f"rejected, {counts['dropped']} dropped)")


def _first_reason(result: RoundResult) -> str:
    """An example of why updates were refused: the first recorded reason, if any."""
    first = next((r for r in result.records if r.fate != "accepted" and r.reason), None)
    return "" if first is None else f"; e.g. client {first.client_id}: {first.reason}"
