"""``[audit]``: canary clients in the server's rounds for the one-shot privacy estimate.

With ``canaries = K`` (0, the default, turns the audit off: no canary ever enters the
run), K canary clients with random unit directions (``privacy.dp.audit``, from OS entropy)
take part in the sync driver's rounds, plain or secure, as the pipeline post stage
:class:`CanaryAudit`, which runs right after the combine and before central DP's noise.
In each released round every canary takes part independently with the run's sampling
rate q (``federation.sample_fraction`` for Poisson sampling, clients per round over
clients for fixed-size sampling), from OS entropy, and contributes:

- with DP (central or distributed): its direction times the clip norm C, into the clipped
  sum before central noise (central DP, plain or secure), or into the decoded noisy sum
  (distributed DP, where the clients' noise is already in it);
- without DP: its direction times ``canary_norm``, or, when that is 0, the median L2 norm
  of the round's accepted updates (the server sees no update under secure aggregation,
  so there ``canary_norm`` must be set), as one average client of a mean.

Canaries are never counted as clients: not in the divisor (central DP divides by the
public expected count, a mean by the real clients), not in the accountant, not in the
accepted or rejected counts. At the end of the run the estimate (``epsilon_audit``) comes
from ``theta_T - theta_0``; its delta is the run's ``dp.delta``, or 1e-5 without DP.

Beside it stand its one-sided 95% lower confidence bound (``epsilon_audit_lower``, a
bootstrap over the canaries: ``privacy.dp.audit``) and, with DP, the exact epsilon of what
a canary goes through (``epsilon_audit_reference``): in each released round it takes part
with probability q, independently and in secret, and meets the Gaussian noise of that
round, so the reference is the PLD epsilon (dp_accounting, add/remove-one) of Poisson(q)
sampled Gaussian rounds, each at the multiplier recorded when it was released (central
DP: the noise on the clipped sum, ``update_noise_multiplier``; distributed DP: the
multiplier the round is charged, fewer clients' noise after dropouts). It is the figure
for the released model's consumers (``epsilon_model`` under distributed DP, not the
server's ``epsilon``), composed over every round, so what the final model alone reveals
stays below it. A correct run's estimate scatters around it when the audit is tight
(q = 1); the run is flagged (``audit_flag``, and a warning line) only when the lower
bound exceeds it. Without DP there is no reference and no flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from aggregation import PostStage
from privacy.dp.audit import AuditEstimate, audit_epsilon, canary_entropy, random_canaries
from privacy.dp.relations import ADD_REMOVE
from server.config import AuditConfig, FederationConfig

if TYPE_CHECKING:
    from privacy.dp.accountant import PrivacyAccountant
    from server.dp import DPController
    from server.rounds import RoundResult
    from server.scenario import ServerScenario

DELTA_WITHOUT_DP = 1e-5


def sampling_rate(fed: FederationConfig) -> float:
    """The probability that a given client takes part in a round."""
    return fed.expected_per_round() / fed.clients


def canary_accountant(rate: float, delta: float) -> PrivacyAccountant:
    """The exact (PLD) accountant of one canary: Poisson(``rate``) sampled Gaussian rounds
    under add/remove-one (unsampled at rate 1)."""
    from privacy.dp.accountant import PrivacyAccountant  # dp_accounting: heavy, load late

    if rate >= 1.0:
        return PrivacyAccountant(1.0, delta=delta, sampling="none", accountant="pld",
                                 relation=ADD_REMOVE)
    return PrivacyAccountant(1.0, delta=delta, sampling_rate=rate, accountant="pld",
                             relation=ADD_REMOVE)


class CanaryAudit(PostStage):
    """The canaries of one run: a post stage that adds the round's participating canaries
    to the aggregate (see the module docstring), and the estimate at the end."""

    def __init__(self, config: AuditConfig, *, rate: float, combine: str,
                 dp: DPController | None = None) -> None:
        if not config.enabled:
            raise ValueError("CanaryAudit needs audit.canaries >= 2")
        self.config = config
        self.rate = rate
        self.combine = combine
        self.dp = dp
        self.entropy = canary_entropy()
        self.rng = np.random.default_rng()  # participation: OS entropy, never the run seed
        self.canaries: np.ndarray | None = None  # (K, d) unit rows, drawn at the first round
        self.participations = np.zeros(config.canaries, dtype=np.int64)
        self.rounds = 0  # released rounds the canaries could take part in
        # each released round's noise multiplier, as a canary meets it (None without DP)
        self.accountant = canary_accountant(rate, self.delta) if dp is not None else None
        self._round_norms: list[float] = []
        self._round_multiplier: float | None = None

    @property
    def delta(self) -> float:
        return float(self.dp.config.delta) if self.dp is not None else DELTA_WITHOUT_DP

    def observe_round(self, result: RoundResult) -> None:
        """What the round source reports before the aggregate is applied: the norms of the
        accepted updates (they size the canaries without DP; a rejected update never
        does) and the multiplier of the noise actually in the sum, if it differs."""
        self._round_norms = [float(r.norm) for r in result.records
                             if r.fate == "accepted" and r.norm is not None]
        self._round_multiplier = result.noise_multiplier

    def multiplier(self) -> float:
        """This round's noise std over a canary's norm (DP runs only)."""
        dp = self.dp
        assert dp is not None
        if dp.config.mode == "distributed":  # what the round is charged (dropouts: less)
            return (dp.round_noise_multiplier if self._round_multiplier is None
                    else float(self._round_multiplier))
        return float(dp.update_noise_multiplier)  # central: the noise on the clipped sum

    def _norm_and_scale(self, count: int) -> tuple[float, float]:
        """A canary's norm and the factor that puts it on the aggregate's scale."""
        if self.dp is not None:
            if self.dp.config.mode == "distributed":  # the decoded sum over the public count
                return self.dp.clip, 1.0 / self.dp.clients_per_round
            return self.dp.clip, 1.0  # central: the clipped sum, before the noise
        norm = self.config.canary_norm or (float(np.median(self._round_norms))
                                           if self._round_norms else 0.0)
        # a mean: one average client among the round's real ones; a sum: one more term
        return norm, (1.0 / max(count, 1) if self.combine == "mean" else 1.0)

    def apply(self, aggregate: np.ndarray, total_weight: float, count: int) -> np.ndarray:
        if self.canaries is None:
            self.canaries = random_canaries(self.config.canaries, aggregate.size, self.entropy)
        taking_part = self.rng.random(self.config.canaries) < self.rate
        self.rounds += 1
        self.participations += taking_part
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.multiplier())
        norm, scale = self._norm_and_scale(count)
        self._round_norms, self._round_multiplier = [], None
        if norm == 0.0 or not taking_part.any():
            return aggregate
        step = taking_part.astype(np.float32) @ self.canaries
        return aggregate + np.float32(norm * scale) * step

    def estimate(self, change: np.ndarray) -> AuditEstimate | None:
        """The estimate from the final model change (None before any released round)."""
        if self.rounds == 0:
            return None
        if self.canaries is None:  # resumed after the last released round
            self.canaries = random_canaries(self.config.canaries, change.size, self.entropy)
        return audit_epsilon(change, self.canaries, self.delta)

    def reference(self) -> float | None:
        """The exact epsilon of what a canary went through (None without DP)."""
        if self.accountant is None:
            return None
        return float(self.accountant.epsilon()) if self.accountant.rounds else 0.0

    def summary(self, change: np.ndarray) -> dict[str, Any]:
        """``epsilon_audit``, its lower bound, the reference and the flag, for the run
        summary (see the module docstring)."""
        est = self.estimate(change)
        reference = self.reference()
        out: dict[str, Any] = {"audit_canaries": self.config.canaries,
                               "audit_delta": self.delta,
                               "audit_participations": int(self.participations.sum()),
                               "epsilon_audit": None, "epsilon_audit_lower": None,
                               "epsilon_audit_reference": reference, "audit_flag": None}
        if est is not None:
            out.update(epsilon_audit=round(est.epsilon, 6),
                       epsilon_audit_lower=round(est.epsilon_lower, 6),
                       audit_mu=round(est.mu, 6), audit_mu_lower=round(est.mu_lower, 6),
                       audit_confidence=est.confidence)
            if reference is not None:
                out.update(audit_flag=bool(est.epsilon_lower > reference),
                           audit_relation=ADD_REMOVE)
        return out

    @staticmethod
    def warning(summary: dict[str, Any]) -> str | None:
        """The loud line for a flagged run (None when the run is not flagged)."""
        if not summary.get("audit_flag"):
            return None
        return (f"WARNING: privacy audit: the {summary['audit_confidence']:.0%} lower bound "
                f"epsilon_audit_lower {summary['epsilon_audit_lower']:.4g} exceeds the exact "
                f"epsilon {summary['epsilon_audit_reference']:.4g} a canary can leak "
                f"({ADD_REMOVE}, delta {summary['audit_delta']:g}): the released model "
                "holds less noise than accounted")

    def state_dict(self) -> dict[str, Any]:
        # the canaries are public probes (no client's data): a resumed run keeps them
        state: dict[str, Any] = {"entropy": str(self.entropy), "rounds": self.rounds,
                                 "participations": self.participations.tolist()}
        if self.accountant is not None:
            state["accountant"] = self.accountant.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "entropy" in state:
            self.entropy = int(state["entropy"])
            self.canaries = None
            self.rounds = int(state["rounds"])
            self.participations = np.asarray(state["participations"], dtype=np.int64)
            if self.accountant is not None:
                self.accountant = canary_accountant(self.rate, self.delta)
                if "accountant" in state:
                    self.accountant.load_state_dict(state["accountant"])
                else:  # saved before multipliers were recorded: a full round's each
                    self.accountant.step(self.rounds, self.multiplier())


def make_audit(scenario: ServerScenario, dp: DPController | None) -> CanaryAudit | None:
    """The run's canary stage, or None without ``[audit]`` (or with ``canaries = 0``); the
    combinations canaries cannot take part in are refused by ``server.settings_checks``."""
    if not scenario.audit.enabled:
        return None
    return CanaryAudit(scenario.audit, rate=sampling_rate(scenario.federation),
                       combine=scenario.aggregation.combine, dp=dp)
