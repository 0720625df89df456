"""The ``[dp]`` section of a scenario, validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from privacy.dp import _checks
from privacy.dp.clipping import split_noise_multiplier
from privacy.dp.relations import RELATIONS, REPLACE_ONE

MODES = ("off", "central", "local", "distributed")
MECHANISMS = ("gaussian", "discrete_gaussian", "skellam")
ACCOUNTANTS = ("rdp", "pld")
ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class DPConfig:
    """Differential privacy settings.

    - ``mode``: off | central (server noises the clipped sum) | local (each client noises
      its clipped delta) | distributed (clients add integer noise under secure aggregation).
    - ``clip``: L2 clip norm, or ``"adaptive"`` (Andrew et al. 2021) starting at
      ``initial_clip`` and tracking ``target_quantile`` with ``clip_learning_rate``;
      ``clipped_count_stddev`` is the noise std on the count of clients below the clip
      (default: clients_per_round / 20, as in the paper).
    - ``noise_multiplier``: z; noise std = z * clip on the sum. With adaptive clipping it is
      the total, shared between the updates and the count.
    - ``delta``, ``epsilon_budget`` (stop before exceeding it; optional), ``accountant``.
    - ``budget_relation``: the neighbouring relation of the figure the budget caps
      (replace-one, the default; add/remove-one; zero-out), against ``epsilon``'s party.
    - ``mechanism``: gaussian for central/local; discrete_gaussian (default) or skellam for
      distributed. ``k_stddevs`` (default: from a 1e-6 wrap probability per round) and
      ``rotation`` tune the distributed plan (``plan_distributed_dp``).
    - ``reproducible_cohorts``: false (default) draws each round's cohort from operating-system
      entropy, so that no one who reads the stored run seed can replay who took part, and
      epsilons against the released model may claim amplification by sampling. True keeps
      the cohorts seeded by the run seed (reproducible simulations) and then claims no
      amplification anywhere: every epsilon is the unsampled Gaussian's.
    """

    mode: str = "off"
    clip: float | str = 1.0
    initial_clip: float = 0.1
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    clipped_count_stddev: float | None = None
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    epsilon_budget: float | None = None
    mechanism: str | None = None
    accountant: str = "rdp"
    k_stddevs: float | None = None
    rotation: bool = True
    reproducible_cohorts: bool = False
    budget_relation: str = REPLACE_ONE

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        mode = _checks.choice("dp.mode", self.mode, MODES)
        if self.clip != ADAPTIVE:
            if isinstance(self.clip, str):
                raise ValueError(f"dp.clip must be a number > 0 or 'adaptive', got {self.clip!r}")
            set_(self, "clip", _checks.positive("dp.clip", self.clip))
        set_(self, "initial_clip", _checks.positive("dp.initial_clip", self.initial_clip))
        set_(self, "target_quantile", _checks.open_unit("dp.target_quantile", self.target_quantile))
        set_(self, "clip_learning_rate",
             _checks.positive("dp.clip_learning_rate", self.clip_learning_rate))
        if self.clipped_count_stddev is not None:
            set_(self, "clipped_count_stddev",
                 _checks.non_negative("dp.clipped_count_stddev", self.clipped_count_stddev))
        z = _checks.non_negative("dp.noise_multiplier", self.noise_multiplier)
        set_(self, "noise_multiplier", z)
        set_(self, "delta", _checks.open_unit("dp.delta", self.delta))
        if self.epsilon_budget is not None:
            set_(self, "epsilon_budget", _checks.positive("dp.epsilon_budget", self.epsilon_budget))
        _checks.choice("dp.accountant", self.accountant, ACCOUNTANTS)
        _checks.choice("dp.budget_relation", self.budget_relation, RELATIONS)
        if self.k_stddevs is not None:
            set_(self, "k_stddevs", _checks.positive("dp.k_stddevs", self.k_stddevs))
        for key in ("rotation", "reproducible_cohorts"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"dp.{key} must be true or false, got {getattr(self, key)!r}")

        default = "discrete_gaussian" if mode == "distributed" else "gaussian"
        mechanism = default if self.mechanism is None else self.mechanism
        _checks.choice("dp.mechanism", mechanism, MECHANISMS)
        if mode == "distributed" and mechanism == "gaussian":
            raise ValueError(
                "dp.mechanism='gaussian' cannot be used with mode='distributed' (noise must be "
                "integer before secure aggregation): set it to discrete_gaussian or skellam"
            )
        if mode in ("central", "local") and mechanism != "gaussian":
            raise ValueError(
                f"dp.mechanism={mechanism!r} is only for mode='distributed'; with "
                f"mode={mode!r} use mechanism='gaussian' or leave it out"
            )
        set_(self, "mechanism", mechanism)

        if self.adaptive and mode == "local":
            raise ValueError(
                "dp.clip='adaptive' needs the server to see only a noised count of clipped "
                "clients, which local DP does not give: use a numeric dp.clip with mode='local'"
            )
        if self.adaptive and self.clipped_count_stddev is not None:
            split_noise_multiplier(z, self.clipped_count_stddev)  # raises if too small
        if self.epsilon_budget is not None and mode != "off" and z == 0.0:
            raise ValueError(
                "dp.epsilon_budget cannot be met with dp.noise_multiplier=0 (no privacy): "
                "set noise_multiplier > 0 or drop epsilon_budget"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def adaptive(self) -> bool:
        return self.clip == ADAPTIVE

    def count_stddev(self, clients_per_round: int) -> float:
        """sigma_b for adaptive clipping: the configured one or clients_per_round / 20."""
        m = _checks.integer("clients_per_round", clients_per_round, 1)
        return self.clipped_count_stddev if self.clipped_count_stddev is not None else m / 20.0

    def update_noise_multiplier(self, clients_per_round: int) -> float:
        """The z applied to the clipped updates: ``noise_multiplier``, or with adaptive
        clipping the share left after the count noise (``split_noise_multiplier``)."""
        if not self.adaptive:
            return self.noise_multiplier
        return split_noise_multiplier(self.noise_multiplier, self.count_stddev(clients_per_round))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> DPConfig:
        """Build from a ``[dp]`` table; unknown keys are refused by name."""
        if not isinstance(d, Mapping):
            raise ValueError(f"[dp] must be a table, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                raise ValueError(f"unknown key {key!r} in [dp]; known keys: {', '.join(known)}")
        return cls(**d)  # type: ignore[arg-type]
