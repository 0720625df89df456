"""Secure federated evaluation (``federation.secure_evaluation = true``): only the totals.

Under secure aggregation a plain evaluate reply tells the server one client's loss,
accuracy and example count on its held-out split. With ``secure_evaluation`` the
evaluation round is a SecAgg+ session instead (``server.secagg_session`` with an
``EvalStart``; the client side is ``client.secure_client.SecureClient
.evaluate``): each client's input is its totals, examples, examples * accuracy and
examples * loss (and the same for its own model under FedBN) as fixed-point words
(``privacy.secagg.eval_words``), so the server learns only their sums over the
survivors, under the same policy as a training session (k, t, ``min_survivors``, each
client checking it too). From them:

- ``federated_clients``: the survivors whose totals are in the sum;
- ``federated_accuracy`` = sum(examples * accuracy) / sum(examples), ``federated_loss``
  likewise (what a plain round's example-weighted means are, up to the fixed-point step
  2^-16 per client and figure);
- ``federated_accuracy_personal`` and ``federated_loss_personal`` when every survivor
  measured its own model;
- ``federated_clipped``: figures the clients clipped to the words' range (a loss above
  ``privacy.secagg.quantize.LOSS_RANGE`` or not finite, an accuracy outside [0, 1], more
  than 2^32 - 1 examples), as a training round counts its clipped coordinates.

No per-client figure exists on the server, so neither does any spread figure (no mean
of the clients' accuracies, std, p10, p90 or min). Each cohort member gets one record:
accepted (a survivor; its figures None, as they are unknown), dropped (the stage and
why) or rejected (why: a refused message, an aborted session, inconsistent totals).
Evaluation is not covered by the DP accounting; the session runs without DP noise.
With ``secagg.security = "malicious"`` the evaluation session holds against a lying
server as a training session does (signed advertisements, the consistency check).

The session itself (k, t, dropouts by stage, seconds) is :attr:`SecureEvaluation.outcome`
(``session_record()``); the store's ``secagg_rounds`` table keeps one session per round,
the training round's, so the evaluation's is not stored there: its records are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from client.protocol.evaluation import evaluate_config
from privacy.secagg.eval_words import MAX_CLIPPED, STEP, EvalTotals, EvalWords
from server.rounds import RunContext
from server.secagg_session import EvalStart, SecAggSession
from server.secure_outcome import SecureRoundOutcome
from server.spread import COUNT, LOSS, PERSONAL, PREFIX, accuracy_key
from server.store import EvalRecord

CLIPPED = f"{PREFIX}_clipped"  # figures the clients clipped to the words' range


def evaluation_session_id(run_id: str) -> int:
    """The 63-bit protocol run id of a run's evaluation sessions: never a training
    session's (``server.secagg_session.session_id``), so no message of one is valid in
    the other."""
    digest = hashlib.sha256(f"fedring-secure-evaluation:{run_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class SecureEvaluation:
    """A secure evaluation round: its records, its metrics and the session's outcome
    (``outcome.session_record()`` has ``Store.record_secagg_round``'s keys)."""

    records: list[EvalRecord]
    metrics: dict[str, float]
    outcome: SecureRoundOutcome


def inconsistency(totals: EvalTotals, survivors: int, words: EvalWords) -> str | None:
    """Why the decoded totals cannot come from ``survivors`` clients following the
    ``words`` layout (a client sent words outside it), or None."""
    slack = survivors * STEP  # each client rounds each product by at most STEP / 2
    if totals.clipped > MAX_CLIPPED * survivors or totals.personal > survivors:
        return (f"{totals.clipped} figures clipped and {totals.personal} personal among "
                f"{survivors} survivors")
    for name, value in (("correct", totals.correct),
                        ("correct (own model)", totals.correct_personal)):
        if value > totals.examples + slack:
            return f"{name} {value:g} exceeds the {totals.examples:g} examples"
    top = totals.examples * words.loss_range + slack
    for name, value in (("loss", totals.loss_sum), ("loss (own model)", totals.loss_sum_personal)):
        if value > top:
            return f"{name} total {value:g} exceeds {words.loss_range:g} per example"
    return None


def totals_metrics(totals: EvalTotals, survivors: int) -> dict[str, float]:
    """The round's federated figures from the survivors' totals ({} without examples)."""
    if totals.examples <= 0:
        return {}
    out = {COUNT: float(survivors), accuracy_key(): totals.correct / totals.examples,
           LOSS: totals.loss_sum / totals.examples, CLIPPED: float(totals.clipped)}
    if totals.personal == survivors:
        out[accuracy_key(personal=True)] = totals.correct_personal / totals.examples
        out[LOSS + PERSONAL] = totals.loss_sum_personal / totals.examples
    return out


def run_secure_evaluation(ctx: RunContext, run_id: str, rnd: int,
                          cohort: list[int]) -> SecureEvaluation:
    """Evaluate the current model on ``cohort``'s held-out splits through the secure sum."""
    settings = ctx.scenario.secagg
    if not settings.enabled:
        raise ValueError("federation.secure_evaluation = true needs secagg.enabled = true")
    config = evaluate_config(rnd, ctx.state.version, ctx.task_json, ctx.seed,
                             local_buffers=ctx.scenario.aggregation.local_buffers)
    words = EvalWords.for_sum(len(cohort), settings.bits)
    session = SecAggSession(ctx.grid, settings, ctx.scenario.aggregation.weight_by,
                            evaluation_session_id(run_id), ctx.fed.round_timeout_s,
                            ctx.fed.poll_s)
    outcome = session.run(cohort, rnd, EvalStart(ctx.model_record(), config, words))
    records = [EvalRecord(r.client_id, r.fate, reason=_reason(r.reason))
               for r in outcome.update_records()]
    totals, metrics = outcome.evaluation, {}
    if totals is not None:
        survivors = len(outcome.survivors)
        why = inconsistency(totals, survivors, words)
        if why is None:
            metrics = totals_metrics(totals, survivors)
        else:
            reason = f"secure evaluation totals rejected: {why}"
            records = [EvalRecord(r.client_id, "rejected", reason=reason)
                       if r.fate == "accepted" else r for r in records]
    return SecureEvaluation(records, metrics, outcome)


def _reason(reason: str | None) -> str | None:
    """A session record's reason, naming the evaluation where it names a round."""
    prefix = "secure round aborted"
    if reason is not None and reason.startswith(prefix):
        return "secure evaluation aborted" + reason[len(prefix):]
    return reason


def secure_evaluate(ctx: RunContext, run_id: str, rnd: int,
                    cohort: list[int]) -> tuple[list[EvalRecord], dict[str, float]]:
    """A secure federated evaluation round: one record per cohort member (accepted
    survivors carry no figures) and the metrics from the survivors' totals only."""
    result = run_secure_evaluation(ctx, run_id, rnd, cohort)
    return result.records, result.metrics
