"""Differential privacy in the server's pipeline: clipping, central noise, the accountant.

``DPController`` holds one run's privacy state: the clip norm (fixed, or adaptive as
in Andrew et al. 2021), the accountant and the noise generator. Its stages plug into
the aggregation pipeline:

- central DP: ``DPClip`` clips every delta to C before weighting (weights must be
  uniform so one client changes the sum by at most C), the combine sums, and
  ``CentralNoise`` adds N(0, (z C)^2) to the sum and divides by the expected number
  of clients per round (a public count, so the noise scale never depends on data);
- local DP: each client clips and noises its own delta (see ``client.app``); the
  server only accounts, per client, for the rounds it could have taken part in;
- central DP under secure aggregation: each client clips its own delta below C by its
  rounding's worst case, so what it adds to the decoded sum stays within C (the server
  never sees one; ``server.secure_round.central_dp_clip``), the secure sum is noised by
  ``CentralNoise`` as above;
- distributed DP (secure aggregation only): :meth:`DPController.plan_distributed` fixes
  the integer scale and noise for the model's size and ``[secagg] bits`` when the run
  starts; each client adds its share of discrete Gaussian or Skellam noise before
  masking (``client.secure_client``), so only the noisy sum is ever decoded. Each round
  is charged the plan's effective multiplier for the clients whose noise is in the sum
  (see ``privacy.dp.distributed`` for the accounting approximation).

The noise generator is seeded from the operating system, never from the run seed:
DP noise that can be replayed from public values protects nothing.

Whom each epsilon protects against (``epsilon`` is the one ``dp.epsilon_budget`` caps):

- central DP: consumers of the released model (the server is trusted). It is amplified by
  the round's sampling only while the cohort draw is secret: cohorts are then drawn from
  operating-system entropy (:attr:`DPController.secret_cohorts`). With
  ``dp.reproducible_cohorts = true`` the stored seed replays who took part, so no
  amplification is claimed.
- local and distributed DP: the server, which picks and addresses the cohort, so never
  amplified. A second figure, ``epsilon_model``, is stated against consumers of the
  released model, amplified by the secret draw (absent with reproducible cohorts, where
  it would equal ``epsilon``). Local DP's model figure charges each client's own noised
  update (multiplier z), whatever the others add.

With fixed-size sampling of every client in every round (``sample_fraction = 1``, or a
``min_clients`` floor at ``clients``) nothing is sampled: every figure is the plain
Gaussian under add/remove, as for reproducible cohorts, and no ``epsilon_model`` is
stated (it would equal ``epsilon``).

The sampling accounted is the sampling that happened. Fixed-size sampling is charged per
round against the population the cohort was actually drawn from (the eligible nodes) and
the cohort's actual size (:meth:`DPController.note_cohort`: a ``min_clients`` floor or a
``driver.concurrency`` cap only change that size, the draw stays uniform), under
replace-one, so its epsilon and the add/remove ones differ by the relation too (see
``privacy.dp.accountant``); each figure names its relation. Poisson is charged
``federation.sample_fraction``. What the per-round figures cannot model is refused: at
start (``server.rules.check_dp_sampling``) ``driver.late_policy = 'carry'``,
``clients.offline_fraction > 0`` and a concurrency cap on Poisson cohorts; at run time
the sync driver stops if a client is left out of the eligible nodes (busy with a late
task), since who can be sampled would then depend on earlier, secret cohorts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregation import Candidate, PostStage, UpdateStage
from privacy.dp import AdaptiveClip, DistributedDPPlan, DPConfig, central_dp_mean
from privacy.dp.distributed import MAX_BITS, plan_distributed_dp
from server.config import FederationConfig


@dataclass(frozen=True)
class RoundPrivacy:
    """What one released aggregate cost and where the run stands."""

    epsilon: float
    delta: float
    noise_multiplier: float
    clip: float
    sampling_rate: float
    protects_against: str  # whom ``epsilon`` is stated against
    epsilon_model: float | None = None  # against the released model's consumers, if it differs


SERVER = "server"
RELEASED_MODEL = "released model"


class DPController:
    """One run's clip norm, accountants and noise generator."""

    def __init__(self, config: DPConfig, *, clients: int, clients_per_round: int,
                 sampling: str, sampling_rate: float | None = None) -> None:
        """``clients_per_round``: the expected (public) cohort size, which central noise
        divides by; ``sampling_rate``: Poisson's per-client probability (default
        ``clients_per_round / clients``)."""
        if not config.enabled:
            raise ValueError("DPController needs dp.mode other than 'off'")
        from privacy.dp.accountant import PrivacyAccountant  # dp_accounting: heavy, load late

        self.config = config
        self.clients_per_round = clients_per_round
        self.rng = np.random.default_rng()  # OS entropy: see the module docstring
        self.adaptive: AdaptiveClip | None = None
        if config.adaptive:
            self.adaptive = AdaptiveClip(config.initial_clip, config.target_quantile,
                                         config.clip_learning_rate,
                                         config.count_stddev(clients_per_round))
        self._fixed_clip = None if config.adaptive else float(config.clip)
        # computed now so an impossible split of z fails when the run is configured
        self.update_noise_multiplier = config.update_noise_multiplier(clients_per_round)
        self._below = 0
        self._reported = 0
        self._cohort: tuple[int, int] | None = None  # this round's (population, cohort size)
        self.plan: DistributedDPPlan | None = None  # distributed DP, once the model is known
        # the multiplier a full round is charged (distributed DP: the plan's effective one)
        self.round_noise_multiplier = config.noise_multiplier
        z, delta, kind = config.noise_multiplier, config.delta, config.accountant
        unamplified = PrivacyAccountant(z, delta=delta, sampling="none", accountant=kind)
        if sampling == "fixed" and clients_per_round >= clients:
            # every client in every round: no sampling to amplify, and the sum over all
            # clients moves by C when one is added or removed
            amplified = unamplified
        elif sampling == "poisson":
            rate = clients_per_round / clients if sampling_rate is None else sampling_rate
            amplified = PrivacyAccountant(z, delta=delta, sampling_rate=rate, accountant=kind)
        else:
            amplified = PrivacyAccountant(z, delta=delta, sampling="fixed",
                                          clients_per_round=clients_per_round,
                                          population=clients, accountant=kind)
        secret = self.secret_cohorts
        if config.mode == "central":
            self.protects_against = RELEASED_MODEL
            self.accountant = amplified if secret else unamplified
            self.model_accountant: PrivacyAccountant | None = None
        else:  # local, distributed: the server knows the cohort it drew
            self.protects_against = SERVER
            self.accountant = unamplified
            self.model_accountant = amplified if secret and amplified is not unamplified \
                else None

    @property
    def secret_cohorts(self) -> bool:
        """Whether cohorts must be drawn from OS entropy (the draw stays secret), which is
        what lets an epsilon against the released model claim amplification."""
        return not self.config.reproducible_cohorts

    @property
    def relation(self) -> str:
        """The neighbouring relation of ``epsilon``."""
        return self.accountant.relation

    @property
    def model_relation(self) -> str | None:
        """The neighbouring relation of ``epsilon_model`` (None without one)."""
        return self.model_accountant.relation if self.model_accountant is not None else None

    def note_cohort(self, population: int, cohort: int) -> None:
        """The round's cohort of ``cohort`` clients was drawn from ``population`` eligible
        ones: what fixed-size sampling charges the round (the sampling that happened, not
        the one configured)."""
        self._cohort = (int(population), int(cohort))

    @property
    def clip(self) -> float:
        """The clip norm for the current round."""
        return self.adaptive.clip if self.adaptive is not None else float(self._fixed_clip)

    def observe(self, norm: float) -> None:
        """Count a client whose unclipped norm is within the clip (adaptive clipping)."""
        self._reported += 1
        if norm <= self.clip:
            self._below += 1

    def next_round_exceeds_budget(self) -> float | None:
        """The epsilon the next round would reach, if that is over the budget; else None."""
        return self.release_exceeds_budget(self.round_noise_multiplier)

    def release_exceeds_budget(self, noise_multiplier: float) -> float | None:
        """The epsilon one more round at ``noise_multiplier`` would reach, if over budget."""
        budget = self.config.epsilon_budget
        if budget is None:
            return None
        after = self.accountant.epsilon_after(1, noise_multiplier)
        return after if after > budget else None

    def plan_distributed(self, *, dim: int, bits: int, max_clients: int) -> DistributedDPPlan:
        """Fix distributed DP's scale and noise for a ``dim``-parameter model summed over
        at most ``max_clients`` clients in Z_(2^bits); ValueError naming ``[secagg] bits``
        when the noisy sum cannot fit (checked when the run starts)."""
        if self.config.mode != "distributed":
            raise ValueError("plan_distributed needs dp.mode = 'distributed'")
        where = f"for {max_clients} clients per round and a {dim}-parameter model"
        if bits > MAX_BITS:
            raise ValueError(f"secagg.bits = {bits} is too large for distributed DP {where}: "
                             f"its integer sums are decoded exactly only up to {MAX_BITS} "
                             f"bits; set secagg.bits <= {MAX_BITS}")
        try:
            plan = plan_distributed_dp(
                max_clients, dim, float(self.config.clip), self.config.noise_multiplier, bits,
                str(self.config.mechanism), k_stddevs=self.config.k_stddevs,
                rotate=self.config.rotation)
        except ValueError as exc:
            raise ValueError(f"secagg.bits = {bits} cannot hold distributed DP's noisy sum "
                             f"{where} without wrapping around 2^{bits}: {exc} (the bits "
                             "are secagg.bits; the clients per round come from "
                             "federation.clients and federation.sample_fraction)") from None
        self.plan = plan
        self.round_noise_multiplier = plan.effective_noise_multiplier
        return plan

    def end_round(self, released: bool, noise_multiplier: float | None = None) -> RoundPrivacy:
        """Account a released aggregate and move the adaptive clip; returns the ledger entry.

        ``noise_multiplier`` is what this round is charged when it differs from a full
        round's (distributed DP with dropouts); default :attr:`round_noise_multiplier`.
        A fixed-size round is charged the cohort given to :meth:`note_cohort`.
        """
        clip = self.clip
        z = self.round_noise_multiplier if noise_multiplier is None else noise_multiplier
        if released:
            for accountant in self._accountants():
                population, cohort = (self._cohort if accountant.sampling == "fixed"
                                      and self._cohort is not None else (None, None))
                accountant.step(noise_multiplier=z, population=population, cohort=cohort)
            if self.adaptive is not None:
                self.adaptive.update(self._below, self.clients_per_round, self.rng,
                                     reported=self._reported)
        self._below = self._reported = 0
        self._cohort = None
        return RoundPrivacy(epsilon=self.epsilon(), delta=self.config.delta,
                            noise_multiplier=z, clip=clip,
                            sampling_rate=self.accountant.sampling_rate,
                            protects_against=self.protects_against,
                            epsilon_model=self.epsilon_model())

    def epsilon(self) -> float:
        """Epsilon against :attr:`protects_against` (what the budget caps)."""
        return float(self.accountant.epsilon()) if self.accountant.rounds else 0.0

    def epsilon_model(self) -> float | None:
        """Epsilon against the released model's consumers, where it differs from
        :meth:`epsilon` (local and distributed DP with secret cohorts); else None."""
        acc = self.model_accountant
        if acc is None:
            return None
        return float(acc.epsilon()) if acc.rounds else 0.0

    def summary(self) -> dict[str, Any]:
        """The run summary's privacy keys."""
        out: dict[str, Any] = {"epsilon": self.epsilon(), "delta": self.config.delta,
                               "dp_mode": self.config.mode,
                               "protects_against": self.protects_against,
                               "relation": self.relation}
        model = self.epsilon_model()
        if model is not None:
            out.update(epsilon_model=model, relation_model=self.model_relation)
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"accountant": self.accountant.state_dict()}
        if self.model_accountant is not None:
            state["model_accountant"] = self.model_accountant.state_dict()
        if self.adaptive is not None:
            state["adaptive_clip"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the accountants and the clip. A state saved before the accountants were
        split by adversary (no ``model_accountant`` key) replays its runs of ``(z, rounds)``
        into each accountant."""
        legacy = self.config.mode != "central" and "model_accountant" not in state
        if legacy:  # local and distributed DP were accounted with one accountant
            for accountant in self._accountants():
                for z, n, *_ in state["accountant"]["history"]:
                    accountant.step(n, z)
        else:
            self.accountant.load_state_dict(state["accountant"])
            if self.model_accountant is not None:
                self.model_accountant.load_state_dict(state["model_accountant"])
        if self.adaptive is not None and "adaptive_clip" in state:
            self.adaptive.load_state_dict(state["adaptive_clip"])

    def _accountants(self) -> list[Any]:
        return [a for a in (self.accountant, self.model_accountant) if a is not None]

    def stages(self) -> tuple[list[UpdateStage], list[PostStage]]:
        """The pipeline stages central DP adds (none for local DP, which runs on clients)."""
        if self.config.mode != "central":
            return [], []
        return [DPClip(self)], [CentralNoise(self)]


class DPClip(UpdateStage):
    """Clip each delta to the controller's current clip (and count it for adaptive clipping)."""

    def __init__(self, controller: DPController) -> None:
        self.controller = controller

    def process(self, c: Candidate, dim: int, version: int) -> None:
        norm = c.l2_norm()
        self.controller.observe(norm)
        clip = self.controller.clip
        if norm > clip:
            c.update.delta = c.update.delta * np.float32(clip / norm)
            c.norm = clip


class CentralNoise(PostStage):
    """(clipped sum + N(0, (z C)^2)) / expected clients per round."""

    def __init__(self, controller: DPController) -> None:
        self.controller = controller

    def apply(self, aggregate: np.ndarray, total_weight: float, count: int) -> np.ndarray:
        c = self.controller
        return central_dp_mean(aggregate, c.clients_per_round, c.clip,
                               c.update_noise_multiplier, c.rng)


def figure_relations(dp: DPConfig, sampling: str) -> tuple[str, str | None]:
    """The neighbouring relations of a run's ``epsilon`` and ``epsilon_model`` (None when
    there is no model figure), as :class:`DPController` states them, from its config."""
    from privacy.dp.accountant import relation

    secret = not dp.reproducible_cohorts
    if dp.mode == "central":
        return relation(sampling if secret else "none"), None
    return relation("none"), relation(sampling) if secret else None


def dp_controller(dp: DPConfig, fed: FederationConfig) -> DPController:
    """The run's privacy controller for a validated ``[dp]`` and ``[federation]``."""
    poisson = fed.sampling == "poisson"
    per_round = fed.expected_per_round()
    return DPController(dp, clients=fed.clients, clients_per_round=max(1, round(per_round)),
                        sampling=fed.sampling,
                        sampling_rate=fed.sample_fraction if poisson else None)
