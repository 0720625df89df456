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
  never sees one; ``server.secure_aggregation.central_dp_clip``), the secure sum is noised by
  ``CentralNoise`` as above;
- distributed DP (secure aggregation only): :meth:`DPController.plan_distributed` fixes
  the integer scale and noise for the model's size and ``[secagg] bits`` when the run
  starts; each client adds its share of discrete Gaussian or Skellam noise before
  masking (``client.secure_client``), so only the noisy sum is ever decoded. Each round
  is charged the plan's effective multiplier for the clients whose noise is in the sum
  (see ``privacy.dp.distributed`` for the accounting approximation).

Noise to signal (central DP only): ``CentralNoise`` records each round's L2 norm of the
noise it added over that of the clipped sum it was added to (both are divided by the
same count, so this is the noise's norm over the mean clipped update's, on the released
scale). Under local and distributed DP the server never sees the noise apart from the
updates, so no ratio is recorded. When it stays above 1 for :data:`HINT_ROUNDS` released
rounds in a row, the run warns once with the keys that help (:func:`noise_hint`).

The noise generator is seeded from the operating system, never from the run seed:
DP noise that can be replayed from public values protects nothing.

Whom each epsilon protects against, and under which neighbouring relation
(:func:`figure_specs`; every figure carries its relation to the ledger, the summary and
the report):

- central DP: consumers of the released model (the server is trusted). ``epsilon`` is
  amplified by the round's sampling only while the cohort draw is secret: cohorts are
  then drawn from operating-system entropy (:attr:`DPController.secret_cohorts`); it is
  replace-one under fixed-size sampling, add/remove-one under Poisson sampling, every
  client in every round or ``dp.reproducible_cohorts = true`` (the stored seed replays
  who took part: no amplification).
- local and distributed DP: the server, which picks the cohort and sees who replied, so
  never amplified, under zero-out (a client's contribution moved between its value and
  zero, its participation known; the Gaussian at z). A second figure,
  ``epsilon_model``, is stated against consumers of the released model, amplified by
  a secret fixed-size draw. Not under Poisson sampling: each client adds its own noise,
  so the model change's size reveals how many took part, which amplification by
  Poisson sampling assumes secret. Local DP's model figure charges each client's own
  noised update (multiplier z), whatever the others add.
- wherever ``epsilon`` is not replace-one, ``epsilon_replace_one`` states it against the
  same party under replace-one (the sum moves by 2C): fixed-size from dp_accounting's
  RDP accountant, Poisson from its PLD accountant, unsampled as the Gaussian at z / 2.

``dp.epsilon_budget`` caps the figure against ``epsilon``'s party under
``dp.budget_relation`` (default replace-one), so one budget means one thing whatever the
sampling and whether cohorts are secret.

The sampling accounted is the sampling that happened. Fixed-size sampling is charged per
round against the population the cohort was actually drawn from (the eligible nodes) and
the cohort's actual size (:meth:`DPController.note_cohort`: a ``min_clients`` floor or a
``driver.concurrency`` cap only change that size, the draw stays uniform), under
replace-one, so its epsilon and the add/remove ones differ by the relation too (see
``privacy.dp.accountant``); each figure names its relation. Poisson is charged
``federation.sample_fraction``. What the per-round figures cannot model is refused: at
start (``server.settings_checks.check_dp_sampling``) ``driver.late_policy = 'carry'``,
``clients.offline_fraction > 0`` and a concurrency cap on Poisson cohorts; at run time
the sync driver stops if a client is left out of the eligible nodes (busy with a late
task), since who can be sampled would then depend on earlier, secret cohorts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregation import Candidate, PostStage, UpdateStage
from privacy.dp import AdaptiveClip, DistributedDPPlan, DPConfig, central_dp_mean
from privacy.dp.distributed import MAX_BITS, plan_distributed_dp
from privacy.dp.relations import ADD_REMOVE, REPLACE_ONE, ZERO_OUT
from server.config import FederationConfig


@dataclass(frozen=True)
class RoundPrivacy:
    """What one released aggregate cost and where the run stands: every figure with the
    neighbouring relation it is stated for."""

    epsilon: float
    delta: float
    noise_multiplier: float
    clip: float
    sampling_rate: float
    protects_against: str  # whom ``epsilon`` and ``epsilon_replace_one`` are stated against
    relation: str = ADD_REMOVE  # ``epsilon``'s
    epsilon_replace_one: float | None = None  # against the same party, where ``relation`` differs
    epsilon_model: float | None = None  # against the released model's consumers, if it differs
    relation_model: str | None = None
    noise_to_signal: float | None = None  # central DP: the round's noise norm / signal norm
    hint: str | None = None  # the warning that the noise drowns the updates, the round it fires


SERVER = "server"
RELEASED_MODEL = "released model"
HINT_ROUNDS = 3  # released rounds in a row with noise over signal above 1 before the hint


def noise_hint(last: float, *, cohort: int, noise_multiplier: float,
               median_norm: float | None, clip: float) -> str:
    """The warning for a run whose central noise outweighs the mean clipped update, with the
    keys that lower the ratio: it falls as 1 / clients per round at best (the noise on the
    mean shrinks, the mean update stays or shrinks) and with the multiplier; the clip
    scales noise and clipped updates alike, so a smaller one helps only where most updates
    stay below it."""
    finite = bool(np.isfinite(last))
    shown = f"{last:.3g}" if finite else "inf (a zero sum)"
    more = f"at least {int(np.ceil(cohort * last))} instead of {cohort} for a ratio of 1: " \
        if finite else ""
    smaller = f"below {noise_multiplier / last:.2g} at this cohort, " if finite else ""
    if median_norm is None:  # the clients clipped (secure aggregation): no norm seen
        clip_text = ("dp.clip: the noise grows with it, the updates only up to their norms, "
                     "so a clip above most updates' norms adds noise without signal")
    elif median_norm < clip:
        clip_text = (f"a smaller dp.clip, near the updates' median norm {median_norm:.3g} "
                     f"(now {clip:.3g}): the noise grows with the clip, the updates only "
                     "up to their norms")
    else:
        clip_text = (f"dp.clip scales noise and signal alike while the updates reach it "
                     f"(median norm {median_norm:.3g}, clip {clip:.3g}): a larger clip takes "
                     "larger steps, not cleaner ones")
    return (f"central DP: noise to signal stayed above 1 for {HINT_ROUNDS} rounds in a row "
            f"({shown} in the last): each round's model change is mostly noise, so learning "
            f"relies on it averaging out over rounds and may stall. What lowers it: more "
            f"clients per round ({more}federation.clients, federation.sample_fraction); a "
            f"smaller dp.noise_multiplier ({smaller}for a higher epsilon); {clip_text}")


@dataclass(frozen=True)
class FigureSpec:
    """One epsilon a run reports: its key, whom it protects against, its relation and the
    sampling its accountant charges ("fixed", "poisson" or "none": no amplification)."""

    key: str
    against: str
    relation: str
    sampling: str


def figure_specs(dp: DPConfig, *, sampling: str, sampled: bool) -> list[FigureSpec]:
    """The figures a run with ``dp`` reports, first ``epsilon`` (see the module docstring).

    ``sampled``: whether a round's cohort is a proper random subset (False when every
    client takes part in every round). Amplification needs a secret draw and, for the
    released model under local and distributed DP, a fixed cohort size: there each client
    adds its own noise, so the model change's size tells how many took part, which a
    Poisson draw keeps secret only in name.
    """
    amplified = sampled and not dp.reproducible_cohorts
    if dp.mode == "central":
        if amplified and sampling == "fixed":
            return [FigureSpec("epsilon", RELEASED_MODEL, REPLACE_ONE, "fixed")]
        how = sampling if amplified else "none"
        return [FigureSpec("epsilon", RELEASED_MODEL, ADD_REMOVE, how),
                FigureSpec("epsilon_replace_one", RELEASED_MODEL, REPLACE_ONE, how)]
    specs = [FigureSpec("epsilon", SERVER, ZERO_OUT, "none"),
             FigureSpec("epsilon_replace_one", SERVER, REPLACE_ONE, "none")]
    if amplified and sampling == "fixed":
        specs.append(FigureSpec("epsilon_model", RELEASED_MODEL, REPLACE_ONE, "fixed"))
    return specs


def budget_spec(dp: DPConfig, specs: list[FigureSpec]) -> FigureSpec:
    """The figure ``dp.epsilon_budget`` caps: against ``epsilon``'s party, under
    ``dp.budget_relation``; ValueError naming the key when the run has no such figure."""
    against = specs[0].against
    for spec in specs:
        if spec.against == against and spec.relation == dp.budget_relation:
            return spec
    have = ", ".join(sorted({s.relation for s in specs if s.against == against}))
    raise ValueError(f"dp.budget_relation = {dp.budget_relation!r}: this run states no "
                     f"figure against the {against} under it (it has: {have}); set "
                     f"dp.budget_relation to one of those")


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
        self._noise: float | None = None  # this round's noise norm over the signal's
        self._norms: list[float] = []  # this round's unclipped norms (plain central DP)
        self._ratios: deque[float] = deque(maxlen=HINT_ROUNDS)  # the last released rounds'
        self.hint: str | None = None  # the noise-to-signal warning, once it fired
        self.plan: DistributedDPPlan | None = None  # distributed DP, once the model is known
        # the multiplier a full round is charged (distributed DP: the plan's effective one)
        self.round_noise_multiplier = config.noise_multiplier
        rate = clients_per_round / clients if sampling_rate is None else sampling_rate
        sampled = rate < 1.0 if sampling == "poisson" else clients_per_round < clients
        self.specs = figure_specs(config, sampling=sampling, sampled=sampled)
        self.budget = budget_spec(config, self.specs)
        z, delta, kind = config.noise_multiplier, config.delta, config.accountant

        def accountant(spec: FigureSpec) -> PrivacyAccountant:
            if spec.sampling == "fixed":
                return PrivacyAccountant(z, delta=delta, sampling="fixed", accountant=kind,
                                         clients_per_round=clients_per_round,
                                         population=clients)
            if spec.sampling == "poisson":  # replace-one Poisson: PLD only in dp_accounting
                how = "pld" if spec.relation == REPLACE_ONE else kind
                return PrivacyAccountant(z, delta=delta, sampling_rate=rate, accountant=how,
                                         relation=spec.relation)
            return PrivacyAccountant(z, delta=delta, sampling="none", accountant=kind,
                                     relation=spec.relation)

        self.accountants = {spec.key: accountant(spec) for spec in self.specs}
        self.protects_against = self.specs[0].against

    @property
    def accountant(self) -> Any:
        """The accountant of ``epsilon``."""
        return self.accountants["epsilon"]

    @property
    def secret_cohorts(self) -> bool:
        """Whether cohorts must be drawn from OS entropy (the draw stays secret), which is
        what lets an epsilon against the released model claim amplification."""
        return not self.config.reproducible_cohorts

    @property
    def relation(self) -> str:
        """The neighbouring relation of ``epsilon``."""
        return self.specs[0].relation

    @property
    def model_relation(self) -> str | None:
        """The neighbouring relation of ``epsilon_model`` (None without one)."""
        return next((s.relation for s in self.specs if s.key == "epsilon_model"), None)

    def figure_labels(self) -> dict[str, str]:
        """Each figure's key with whom it protects against and its relation, e.g.
        ``{"epsilon": "against the server, zero-out", ...}``."""
        return {s.key: f"against the {s.against}, {s.relation}" for s in self.specs}

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
        self._norms.append(float(norm))
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
        after = self.accountants[self.budget.key].epsilon_after(1, noise_multiplier)
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
        ratio, hint = self._noise_to_signal(released, clip)
        if released:
            for accountant in self.accountants.values():
                population, cohort = (self._cohort if accountant.sampling == "fixed"
                                      and self._cohort is not None else (None, None))
                accountant.step(noise_multiplier=z, population=population, cohort=cohort)
            if self.adaptive is not None:
                self.adaptive.update(self._below, self.clients_per_round, self.rng,
                                     reported=self._reported)
        self._below = self._reported = 0
        self._cohort = None
        figures = self.figures()
        return RoundPrivacy(epsilon=figures["epsilon"], delta=self.config.delta,
                            noise_multiplier=z, clip=clip,
                            sampling_rate=self.accountant.sampling_rate,
                            protects_against=self.protects_against, relation=self.relation,
                            epsilon_replace_one=figures.get("epsilon_replace_one"),
                            epsilon_model=figures.get("epsilon_model"),
                            relation_model=self.model_relation,
                            noise_to_signal=ratio if ratio is None or np.isfinite(ratio)
                            else None, hint=hint)

    def note_noise(self, noise_norm: float, signal_norm: float) -> None:
        """This round's central noise and the clipped sum it was added to, by their L2
        norms (what :meth:`end_round` records as noise to signal)."""
        self._noise = (noise_norm / signal_norm if signal_norm > 0
                       else 0.0 if noise_norm == 0 else float("inf"))

    def _noise_to_signal(self, released: bool, clip: float) -> tuple[float | None, str | None]:
        """The round's ratio (None without central noise) and the hint, the round it fires."""
        ratio, norms = self._noise, self._norms
        self._noise, self._norms = None, []
        if not released or ratio is None:
            return None, None
        self._ratios.append(ratio)
        if (self.hint is not None or len(self._ratios) < HINT_ROUNDS
                or not all(r > 1 for r in self._ratios)):
            return ratio, None
        self.hint = noise_hint(ratio, cohort=self.clients_per_round,
                               noise_multiplier=self.config.noise_multiplier,
                               median_norm=float(np.median(norms)) if norms else None,
                               clip=clip)
        return ratio, self.hint

    def figures(self) -> dict[str, float]:
        """Every figure spent so far, by key (see :func:`figure_specs`)."""
        return {key: float(acc.epsilon()) if acc.rounds else 0.0
                for key, acc in self.accountants.items()}

    def epsilon(self) -> float:
        """Epsilon against :attr:`protects_against` under :attr:`relation`."""
        return self.figures()["epsilon"]

    def budget_epsilon(self) -> float:
        """The figure ``dp.epsilon_budget`` caps (under ``dp.budget_relation``)."""
        return self.figures()[self.budget.key]

    def epsilon_model(self) -> float | None:
        """Epsilon against the released model's consumers, where it differs from
        :meth:`epsilon` (local and distributed DP with secret fixed-size cohorts); else
        None."""
        return self.figures().get("epsilon_model")

    def summary(self) -> dict[str, Any]:
        """The run summary's privacy keys: each figure with its relation."""
        figures = self.figures()
        out: dict[str, Any] = {"epsilon": figures["epsilon"], "delta": self.config.delta,
                               "dp_mode": self.config.mode,
                               "protects_against": self.protects_against,
                               "relation": self.relation,
                               "budget_relation": self.budget.relation}
        if "epsilon_replace_one" in figures:
            out["epsilon_replace_one"] = figures["epsilon_replace_one"]
        if "epsilon_model" in figures:
            out.update(epsilon_model=figures["epsilon_model"],
                       relation_model=self.model_relation)
        if self.hint is not None:  # central noise stayed above the mean clipped update
            out["dp_hint"] = self.hint
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"figures": {key: acc.state_dict()
                                             for key, acc in self.accountants.items()}}
        if self.adaptive is not None:
            state["adaptive_clip"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the accountants and the clip. A state saved before every figure had its
        own accountant replays the rounds of its first accountant (``(z, rounds)`` runs,
        and the cohorts of fixed-size runs where the figure is fixed-size) into each."""
        if "figures" in state:
            for key, acc in self.accountants.items():
                acc.load_state_dict(state["figures"][key])
        else:  # older states: one accountant, or one per adversary
            for acc in self.accountants.values():
                source = state.get("model_accountant") if acc.sampling == "fixed" else None
                for z, n, *cohort in (source or state["accountant"])["history"]:
                    population, size = cohort if acc.sampling == "fixed" and cohort \
                        else (None, None)
                    acc.step(n, z, population=population, cohort=size)
        if self.adaptive is not None and "adaptive_clip" in state:
            self.adaptive.load_state_dict(state["adaptive_clip"])

    def hint_state(self) -> dict[str, Any]:
        """The hint's progress: the last released rounds' ratios and the hint, if it fired
        (checkpointed with ``CentralNoise``: values of the noise, apart from the ledger's)."""
        return {"ratios": list(self._ratios), "hint": self.hint}

    def load_hint_state(self, state: dict[str, Any]) -> None:
        self._ratios = deque((float(r) for r in state.get("ratios", [])), maxlen=HINT_ROUNDS)
        self.hint = state.get("hint")

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
    """(clipped sum + N(0, (z C)^2)) / expected clients per round; notes the noise's norm
    over the clipped sum's (the same over the mean: both are divided by the same count)."""

    def __init__(self, controller: DPController) -> None:
        self.controller = controller

    def apply(self, aggregate: np.ndarray, total_weight: float, count: int) -> np.ndarray:
        c = self.controller
        summed = np.asarray(aggregate, dtype=np.float32)
        out = central_dp_mean(summed, c.clients_per_round, c.clip,
                              c.update_noise_multiplier, c.rng)
        c.note_noise(_added_noise_norm(out, summed, c.clients_per_round),
                     float(np.linalg.norm(summed)))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.controller.hint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_hint_state(state)


def _added_noise_norm(released: np.ndarray, summed: np.ndarray, count: int) -> float:
    """The L2 norm of the noise in ``released = (summed + noise) / count``: read back from
    what was released, so it is the noise actually added, whatever drew it."""
    noise = released * np.float32(count)
    noise -= summed
    return float(np.linalg.norm(noise))


def dp_controller(dp: DPConfig, fed: FederationConfig) -> DPController:
    """The run's privacy controller for a validated ``[dp]`` and ``[federation]``."""
    poisson = fed.sampling == "poisson"
    per_round = fed.expected_per_round()
    return DPController(dp, clients=fed.clients, clients_per_round=max(1, round(per_round)),
                        sampling=fed.sampling,
                        sampling_rate=fed.sample_fraction if poisson else None)
