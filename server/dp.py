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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from aggregation import Candidate, PostStage, UpdateStage
from privacy.dp import AdaptiveClip, DistributedDPPlan, DPConfig, central_dp_mean
from privacy.dp.distributed import MAX_BITS, plan_distributed_dp

if TYPE_CHECKING:
    from server.config import FederationConfig


@dataclass(frozen=True)
class RoundPrivacy:
    """What one released aggregate cost and where the run stands."""

    epsilon: float
    delta: float
    noise_multiplier: float
    clip: float
    sampling_rate: float


class DPController:
    """One run's clip norm, accountant and noise generator."""

    def __init__(self, config: DPConfig, *, clients: int, clients_per_round: int,
                 sampling: str) -> None:
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
        self.plan: DistributedDPPlan | None = None  # distributed DP, once the model is known
        # the multiplier a full round is charged (distributed DP: the plan's effective one)
        self.round_noise_multiplier = config.noise_multiplier
        if config.mode == "local":
            # each client's own release: a Gaussian mechanism per round it takes part in
            self.accountant = PrivacyAccountant(config.noise_multiplier, delta=config.delta,
                                                sampling_rate=1.0, accountant=config.accountant)
        elif sampling == "poisson":
            self.accountant = PrivacyAccountant(
                config.noise_multiplier, delta=config.delta,
                sampling_rate=clients_per_round / clients, accountant=config.accountant)
        else:
            self.accountant = PrivacyAccountant(
                config.noise_multiplier, delta=config.delta, sampling="fixed",
                clients_per_round=clients_per_round, population=clients,
                accountant=config.accountant)

    @property
    def clip(self) -> float:
        """The clip norm for the current round."""
        return self.adaptive.clip if self.adaptive is not None else float(self._fixed_clip)

    def observe(self, norm: float) -> None:
        """Count a client whose unclipped norm is within the clip (adaptive clipping)."""
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
        """
        clip = self.clip
        z = self.round_noise_multiplier if noise_multiplier is None else noise_multiplier
        if released:
            self.accountant.step(noise_multiplier=z)
            if self.adaptive is not None:
                self.adaptive.update(self._below, self.clients_per_round, self.rng)
        self._below = 0
        return RoundPrivacy(epsilon=self.epsilon(), delta=self.config.delta,
                            noise_multiplier=z, clip=clip,
                            sampling_rate=self.accountant.sampling_rate)

    def epsilon(self) -> float:
        return float(self.accountant.epsilon()) if self.accountant.rounds else 0.0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"accountant": self.accountant.state_dict()}
        if self.adaptive is not None:
            state["adaptive_clip"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        if self.adaptive is not None and "adaptive_clip" in state:
            self.adaptive.load_state_dict(state["adaptive_clip"])

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


def dp_controller(dp: DPConfig, fed: FederationConfig) -> DPController:
    """The run's privacy controller for a validated ``[dp]`` and ``[federation]``."""
    per_round = (fed.sample_fraction * fed.clients if fed.sampling == "poisson"
                 else fed.clients_per_round(fed.clients))
    return DPController(dp, clients=fed.clients, clients_per_round=max(1, round(per_round)),
                        sampling=fed.sampling)
