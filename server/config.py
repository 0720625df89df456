"""The server's scenario sections, validated: ``[federation]``, ``[aggregation]`` and
``[audit]``."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from aggregation import (
    Pipeline,
    PostStage,
    UpdateStage,
    Validate,
    Weight,
    make_combine,
    make_server_optimizer,
)
from aggregation.arc import ARC
from aggregation.bucketing import Bucketing
from aggregation.combine import Combine
from aggregation.nnm import NNM
from aggregation.pipeline import PreCombine
from aggregation.registry import combine_spec, make_robust_combine, robust_kinds
from aggregation.robust import RobustCombine
from aggregation.server_opt import SERVER_OPTIMIZERS
from aggregation.staleness import StalenessFn, staleness_function

LINEAR_COMBINES = ("mean", "sum")
CLIENT_SIDE_COMBINE = "centered_clip"  # under secagg: each client clips around the centre
STALENESS_KEYS = ("staleness", "staleness_a", "staleness_b", "max_staleness")


# Keys that moved: section.key -> where it is now (an error names the new place)
MOVED_KEYS = {"gossip.holdout_fraction": "data.client_test_fraction (with task.module: "
                                         "task.client_test_fraction): every client's "
                                         "held-out split, gossip silos' too"}


def from_section(cls: type, section: str, values: Mapping[str, Any]) -> Any:
    """Build dataclass ``cls`` from a scenario section; unknown keys and bad types fail."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if f"{section}.{key}" in MOVED_KEYS:
            raise ValueError(f"{section}.{key} moved to {MOVED_KEYS[f'{section}.{key}']}: "
                             f"remove {section}.{key} and set that key instead")
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
                         f"[{section}] takes: {', '.join(sorted(fields))}")
    kwargs = {}
    for key, value in values.items():
        default = fields[key].default
        expected = type(default) if default is not dataclasses.MISSING and default is not None \
            else None
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (expected is not None and not isinstance(value, expected)) or (
                expected is int and isinstance(value, bool)):
            wanted = "true or false" if expected is bool else expected.__name__
            raise ValueError(f"{section}.{key} must be {wanted}, got "
                             f"{type(value).__name__} {value!r}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"[{section}] {exc}") from exc


def check_choice(key: str, value: str, choices: Collection[str]) -> None:
    """A clear error naming ``key`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{key} '{value}' is unknown; choose one of: {', '.join(choices)}")


@dataclass(frozen=True)
class StalenessConfig:
    """The staleness keys of ``[driver]``: s(tau) named by ``staleness`` (constant,
    polynomial, hinge) with ``staleness_a``/``staleness_b``, and ``max_staleness`` (-1: no
    bound). The one place they are checked and built; the pipeline applies them."""

    staleness: str = "constant"
    staleness_a: float = 0.5
    staleness_b: int = 4
    max_staleness: int = -1

    @classmethod
    def of(cls, section: Any) -> StalenessConfig:
        """The staleness keys of a section's config (e.g. an ``AggregationConfig``)."""
        return cls(**{key: getattr(section, key) for key in STALENESS_KEYS})

    def function(self) -> StalenessFn:
        return staleness_function(self.staleness, self.staleness_a, self.staleness_b)

    def bound(self) -> int | None:
        """``max_staleness``, None for no bound."""
        return None if self.max_staleness < 0 else self.max_staleness

    def check(self, section: str, written: Mapping[str, str] | None = None) -> None:
        """A clear error if a key is bad, naming it as ``section.key`` (or as written in the
        section ``written[key]``)."""
        def name(key: str) -> str:
            return f"{(written or {}).get(key, section)}.{key}"

        try:
            self.function()
        except ValueError as exc:
            raise ValueError(f"{name('staleness')}: {exc}") from exc
        if self.max_staleness < -1:
            raise ValueError(f"{name('max_staleness')} must be >= 0, or -1 for no bound, got "
                             f"{self.max_staleness}")


@dataclass(frozen=True)
class FederationConfig:
    """Clients, rounds and how many take part in each round.

    ``evaluate_fraction`` > 0: every ``evaluate_every`` rounds (and after the last) that
    share of the clients evaluates the model on its own held-out split (federated
    evaluation); ``secure_evaluation``: under secure aggregation, only their totals travel,
    through the secure sum."""

    clients: int = 20
    rounds: int = 10
    sample_fraction: float = 1.0
    min_clients: int = 2
    evaluate_fraction: float = 0.0
    evaluate_every: int = 1
    secure_evaluation: bool = False
    round_timeout_s: float = 600.0
    wait_for_nodes_s: float = 60.0
    poll_s: float = 0.05
    checkpoint_every: int = 1
    sampling: str = "fixed"
    max_failed_rounds: int = 3

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"federation.clients must be >= 1, got {self.clients}")
        if self.rounds < 1:
            raise ValueError(f"federation.rounds must be >= 1, got {self.rounds}")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"federation.sample_fraction must be in (0, 1], got "
                             f"{self.sample_fraction}")
        if not 1 <= self.min_clients <= self.clients:
            raise ValueError(f"federation.min_clients must be between 1 and federation.clients "
                             f"({self.clients}), got {self.min_clients}")
        if not 0 <= self.evaluate_fraction <= 1:
            raise ValueError(f"federation.evaluate_fraction must be in [0, 1] (the share "
                             f"of clients asked to evaluate; 0: no federated evaluation), "
                             f"got {self.evaluate_fraction}")
        if self.evaluate_every < 1:
            raise ValueError(f"federation.evaluate_every must be >= 1 (federated evaluation "
                             f"every that many rounds, and after the last), got "
                             f"{self.evaluate_every}")
        if self.round_timeout_s <= 0 or self.wait_for_nodes_s < 0 or self.poll_s <= 0:
            raise ValueError("federation.round_timeout_s and poll_s must be > 0")
        if self.checkpoint_every < 0:
            raise ValueError("federation.checkpoint_every must be >= 0 (0 disables)")
        if self.max_failed_rounds < 0:
            raise ValueError(f"federation.max_failed_rounds must be >= 0 (0: never stop for "
                             f"rounds that apply nothing), got {self.max_failed_rounds}")
        if self.sampling not in ("fixed", "poisson"):
            raise ValueError(f"federation.sampling must be 'fixed' (a fixed number of clients "
                             f"per round) or 'poisson' (each client independently with "
                             f"probability sample_fraction), got '{self.sampling}'")

    def clients_per_round(self, available: int) -> int:
        """How many of ``available`` nodes a fixed-size draw samples in a round."""
        return min(available, max(self.min_clients, round(self.sample_fraction * available)))

    def expected_per_round(self) -> float:
        """The public expected cohort size: ``sample_fraction * clients`` under Poisson
        sampling, else the fixed-size draw from all ``clients``."""
        if self.sampling == "poisson":
            return self.sample_fraction * self.clients
        return float(self.clients_per_round(self.clients))

    def max_per_round(self) -> int:
        """The most clients a round can have (all of them under Poisson sampling)."""
        return self.clients if self.sampling == "poisson" else self.clients_per_round(self.clients)


@dataclass(frozen=True)
class AggregationConfig:
    """The pipeline: validation, weighting, combine and server optimizer.

    ``bucketing`` (0 or 1: off) averages random buckets of that many updates before a
    robust combine; -1 picks ``n / (2 f)`` in each aggregation of ``n`` updates, the
    bound a given size must also keep. ``nnm`` mixes each update with its ``n - f``
    nearest (before bucketing); ``arc`` first clips the
    ``2 f (n - f) / n`` largest updates to the norm of the next largest. ``centered_clip``
    clips to ``clip_radius`` (0: ``clip_scale`` times the median distance) around the
    previous aggregate (``clip_center = "momentum"``: around ``1 - momentum`` times the
    server's momentum buffer) in each of ``clip_iterations``, or of
    ``clip_iterations_late`` (0: off) once ``clip_late_after`` aggregates are applied;
    under secure aggregation the clients do it (``client_side``). ``geometric_median`` runs
    ``gm_iterations`` smoothed Weiszfeld steps with ``gm_nu``. ``client_momentum`` beta > 0:
    each client sends its momentum ``m <- beta m + (1 - beta) delta`` (its first delta
    as is) instead of its delta (worker momentum, Karimireddy, He, Jaggi, ICML 2021).
    """

    combine: str = "mean"
    weight_by: str = "examples"
    server_opt: str = "fedavg"
    server_lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    max_norm: float = 0.0
    f: int = 0
    trim_beta: float = 0.1
    multikrum_m: int = 0
    bulyan_selection: str = "iterated"
    local_buffers: bool = False  # FedBN: batch norm layers and buffers stay on each client
    bucketing: int = 0
    clip_radius: float = 0.0
    clip_iterations: int = 3
    clip_scale: float = 1.0
    clip_iterations_late: int = 0
    clip_late_after: int = 0
    nnm: bool = False
    arc: bool = False
    clip_center: str = "aggregate"
    gm_nu: float = 1e-6
    gm_iterations: int = 8
    client_momentum: float = 0.0

    def __post_init__(self) -> None:
        check_choice("aggregation.combine", self.combine, (*LINEAR_COMBINES, *robust_kinds()))
        check_choice("aggregation.server_opt", self.server_opt, SERVER_OPTIMIZERS)
        if self.max_norm < 0:
            raise ValueError("aggregation.max_norm must be >= 0 (0 means no bound)")
        if self.bucketing < -1:
            raise ValueError(f"aggregation.bucketing must be >= 0 (the bucket size; 0 or 1: "
                             f"no bucketing), or -1 (from aggregation.f), got "
                             f"{self.bucketing}")
        if self.bucketing not in (0, 1) and self.combine in LINEAR_COMBINES:
            raise ValueError(f"aggregation.bucketing = {self.bucketing} averages buckets "
                             f"before a robust combine; the mean of bucket means is the "
                             f"mean, so with aggregation.combine = '{self.combine}' set "
                             "aggregation.bucketing = 0")
        if self.nnm and self.combine in LINEAR_COMBINES:
            raise ValueError(f"aggregation.nnm mixes updates before a robust combine; the "
                             f"mean of the mixes is no robust aggregate, so with "
                             f"aggregation.combine = '{self.combine}' set aggregation.nnm = "
                             "false")
        if self.nnm and self.f < 1:
            raise ValueError("aggregation.nnm mixes each update with its n - f nearest, and "
                             "aggregation.f = 0 would mix all n: every update would become "
                             "the mean, and the robust combine the mean; set aggregation.f to "
                             "the number of attackers to defend against (>= 1)")
        if self.arc and self.combine in LINEAR_COMBINES:
            raise ValueError(f"aggregation.arc clips the largest updates before a robust "
                             f"combine; with aggregation.combine = '{self.combine}' set "
                             "aggregation.arc = false or choose a robust combine")
        if self.arc and self.f < 1:
            raise ValueError("aggregation.arc clips the 2 f (n - f) / n largest updates, none "
                             "with aggregation.f = 0: set aggregation.f to the number of "
                             "attackers to defend against (>= 1)")
        check_choice("aggregation.clip_center", self.clip_center, ("aggregate", "momentum"))
        if self.clip_center == "momentum" and self.server_opt != "fedavgm":
            raise ValueError(f"aggregation.clip_center = 'momentum' centres clipping on the "
                             f"server's momentum buffer, which aggregation.server_opt = "
                             f"'{self.server_opt}' does not keep: set aggregation.server_opt = "
                             "'fedavgm' or aggregation.clip_center = 'aggregate'")
        cc_keys = {"clip_scale": 1.0, "clip_iterations_late": 0, "clip_late_after": 0,
                   "clip_center": "aggregate"}
        for key, default in cc_keys.items():
            if getattr(self, key) != default and self.combine != "centered_clip":
                raise ValueError(f"aggregation.{key} is read by centered clipping only; with "
                                 f"aggregation.combine = '{self.combine}' remove it")
        if self.clip_iterations_late < 0:
            raise ValueError(f"aggregation.clip_iterations_late must be >= 1 (the clipping "
                             f"iterations once aggregation.clip_late_after aggregates are "
                             f"applied), or 0 for none, got {self.clip_iterations_late}")
        if self.clip_late_after and not self.clip_iterations_late:
            raise ValueError("aggregation.clip_late_after says when "
                             "aggregation.clip_iterations_late starts, which is 0 (off): set "
                             "it or remove aggregation.clip_late_after")
        if isinstance(self.client_momentum, bool) or \
                not isinstance(self.client_momentum, int | float) or \
                not 0 <= self.client_momentum < 1:
            raise ValueError(f"aggregation.client_momentum must be a number in [0, 1) (each "
                             f"client's momentum over its own updates; 0: off), got "
                             f"{self.client_momentum!r}")
        self.build()  # surfaces bad combine/weight/optimizer parameters at start

    def _optimizer_params(self) -> dict[str, float]:
        params: dict[str, float] = {"lr": self.server_lr}
        if self.server_opt == "fedavgm":
            params["momentum"] = self.momentum
        elif self.server_opt in ("fedadam", "fedyogi", "fedadagrad"):
            params.update(beta1=self.beta1, beta2=self.beta2, tau=self.tau)
        return params

    def _combine(self, seed: int = 0) -> Combine:
        if self.combine in LINEAR_COMBINES:
            return make_combine(self.combine)
        params = combine_spec(self.combine).params(self)  # its keys of [aggregation]
        try:
            combine = make_robust_combine(self.combine, **params)
        except ValueError as exc:
            raise ValueError(f"aggregation.combine = '{self.combine}': {exc}") from None
        if self.bucketing not in (0, 1):
            combine = Bucketing(combine, None if self.bucketing == -1 else self.bucketing,
                                seed, f=self.f)
        if self.nnm:
            combine = NNM(combine, self.f)
        return ARC(combine, self.f) if self.arc else combine

    def client_side(self, secure: bool) -> bool:
        """Whether the clients clip around the centre themselves (centered clipping under
        secure aggregation, where the server only learns the sum)."""
        return secure and self.combine == CLIENT_SIDE_COMBINE

    def check_clients(self, clients_per_round: int) -> None:
        """Fail at start when a robust combine cannot work with that many updates."""
        combine = self._combine()
        if isinstance(combine, RobustCombine):
            combine.check(clients_per_round)

    def build(self, dp_stages: tuple[list[UpdateStage], list[PostStage]] = ([], []),
              staleness: StalenessConfig | None = None,
              canaries: PostStage | None = None, *, seed: int = 0, secure: bool = False,
              pre_combine: PreCombine | None = None) -> Pipeline:
        """A fresh pipeline for this configuration, with central DP's stages if given
        (``server.dp.DPController.stages``), the staleness weighting and bound of
        ``[driver]``, and the audit's canaries (``server.audit``) right after the combine,
        before any noise. ``seed``: the run seed (bucketing's draws); ``secure``: secure
        aggregation is on (centered clipping then runs on the clients, the server takes
        the mean); ``pre_combine``: see ``Pipeline``."""
        dp_update, dp_post = dp_stages
        staleness = staleness or StalenessConfig()
        client_side = self.client_side(secure)
        combine = make_combine("sum") if dp_post else \
            make_combine("mean") if client_side else self._combine(seed)
        return Pipeline(
            Validate(max_norm=self.max_norm or None, max_staleness=staleness.bound()),
            *dp_update,
            Weight(by=self.weight_by, staleness=staleness.function()),
            combine,
            *([canaries] if canaries is not None else []),
            *dp_post,
            make_server_optimizer(self.server_opt, **self._optimizer_params()),
            client_radius=self.clip_radius if client_side else None,
            pre_combine=pre_combine,
            center_decay=self.momentum if self.clip_center == "momentum" else 0.0,
        )


@dataclass(frozen=True)
class AuditConfig:
    """``[audit]``: ``canaries`` (K; 0 = off) and ``canary_norm`` (runs without DP); the
    canaries themselves: ``server.audit``."""

    canaries: int = 0
    canary_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.canaries < 0 or self.canaries == 1:
            raise ValueError(f"audit.canaries must be 0 (no audit) or at least 2 (a Gaussian "
                             f"is fitted to their cosines; a few hundred give a usable "
                             f"estimate), got {self.canaries}")
        if not self.canary_norm >= 0:
            raise ValueError(f"audit.canary_norm must be >= 0 (0: the median norm of each "
                             f"round's accepted updates), got {self.canary_norm}")

    @property
    def enabled(self) -> bool:
        return self.canaries > 0
