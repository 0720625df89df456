"""Simulated attacks: a fraction of the clients send poisoned updates (``[attack]``).

The attackers are partition ids drawn from the run seed, so every engine and every
resumed run sees the same ones. What they do is ``kind``:

- ``sign_flip``: send ``-factor * delta`` (model poisoning);
- ``scale``: send ``scale * delta``;
- ``gaussian_noise``: send N(0, noise_std^2) noise instead of the delta
  (``noise_mode = "replace"``) or added to it (``"add"``);
- ``label_flip``: train honestly on permuted labels (data poisoning): ``label_map =
  "reverse"`` maps y to num_classes - 1 - y, ``"shift"`` maps y to (y + 1) mod num_classes;
- ``alie`` ("A Little Is Enough", Baruch et al., NeurIPS 2019): every attacker sends
  ``mean - z_max * std`` of the round's honest updates, per coordinate, with
  ``z_max = Phi^-1((n - s) / n)`` and ``s = floor(n / 2 + 1) - m`` for ``n`` updates of
  which ``m`` are the attackers' (``alie_z`` > 0 fixes z instead);
- ``ipm`` (inner-product manipulation, Xie et al., UAI 2020): every attacker sends
  ``-ipm_epsilon * mean`` of the round's honest updates.

Attacks exist in simulations only: the scenario task hands them to the ClientApp, which
applies them to an attacker's delta just before it replies. ``alie`` and ``ipm`` are
omniscient: they need the other clients' updates of the round, which no client has, so
the simulation's ServerApp installs :func:`omniscient_attack` as the pipeline's
pre-combine hook: it replaces the updates of the clients that report the attacker metric
with the forged ones, from the honest updates of that round's batch. No one sees
individual updates under secure aggregation, so these two fail at start there (and with
drivers other than sync rounds).

Each kind is one :class:`AttackSpec` in a registry: what it does to an attacker's delta,
to its labels or to the round's updates, and its own checks; :func:`register_attack` adds
one (the built-ins at the end of this module use it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from aggregation.registry import Registry
from aggregation.update import Update
from client.task import ATTACKER_METRIC

if TYPE_CHECKING:
    from server.scenario import ServerScenario

NOISE_MODES = ("replace", "add")
LABEL_MAPS = ("reverse", "shift")
_STREAM = 0xA77AC  # keeps the attacker draw apart from the run's other seeded draws


@dataclass(frozen=True)
class AttackConfig:
    """``[attack]``: which fraction of the clients attack, and how."""

    fraction: float = 0.0
    kind: str = "sign_flip"
    factor: float = 1.0
    scale: float = 10.0
    noise_std: float = 1.0
    noise_mode: str = "replace"
    label_map: str = "reverse"
    alie_z: float = 0.0
    ipm_epsilon: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"attack.fraction must be in [0, 1] (the share of clients that "
                             f"attack; 0: none), got {self.fraction}")
        attack_spec(self.kind)  # an unknown kind fails naming the registered ones
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"attack.factor must be > 0 (sign_flip sends -factor * delta), "
                             f"got {self.factor}")
        if not math.isfinite(self.scale):
            raise ValueError(f"attack.scale must be a finite number, got {self.scale}")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"attack.noise_std must be >= 0, got {self.noise_std}")
        if self.noise_mode not in NOISE_MODES:
            raise ValueError(f"attack.noise_mode '{self.noise_mode}' is unknown; choose one "
                             f"of: {', '.join(NOISE_MODES)}")
        if not (math.isfinite(self.alie_z) and self.alie_z >= 0):
            raise ValueError(f"attack.alie_z must be >= 0 (0: Baruch et al.'s z_max from the "
                             f"number of clients and attackers), got {self.alie_z}")
        if not (math.isfinite(self.ipm_epsilon) and self.ipm_epsilon > 0):
            raise ValueError(f"attack.ipm_epsilon must be > 0 (ipm sends -epsilon times the "
                             f"honest mean), got {self.ipm_epsilon}")
        if self.label_map not in LABEL_MAPS:
            raise ValueError(f"attack.label_map '{self.label_map}' is unknown; choose one "
                             f"of: {', '.join(LABEL_MAPS)}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    def num_attackers(self, clients: int) -> int:
        """``fraction`` of ``clients``, rounded to the nearest count (halves round up)."""
        return min(clients, math.floor(self.fraction * clients + 0.5 + 1e-9))


def choose_attackers(fraction: float, clients: int, seed: int) -> tuple[int, ...]:
    """The sorted partition ids of the attackers: deterministic for (fraction, clients, seed)."""
    k = AttackConfig(fraction=fraction).num_attackers(clients)
    rng = np.random.default_rng([seed, _STREAM])
    return tuple(sorted(int(i) for i in rng.choice(clients, size=k, replace=False)))


@dataclass(frozen=True)
class AttackSpec:
    """One attack kind. ``tamper(delta, config, seed)`` poisons an attacker's delta in place
    (None: sent as trained); ``labels(y, num_classes, config)``: the labels an attacker
    trains on (None: its own); ``forge(honest, n, m, config)``: the update each of the
    ``m`` attackers among ``n`` sends, from the rows of ``honest`` (the round's honest
    updates; None: not omniscient); ``rules``: its checks at start, each taking the typed
    scenario and the ``[attack]`` section."""

    name: str
    tamper: Callable[[np.ndarray, AttackConfig, int], None] | None = None
    labels: Callable[[torch.Tensor, int, AttackConfig], torch.Tensor] | None = None
    forge: Callable[[np.ndarray, int, int, AttackConfig], np.ndarray] | None = None
    rules: tuple[Callable[[ServerScenario, AttackConfig], None], ...] = ()


_ATTACKS: Registry[AttackSpec] = Registry(
    "attack", lambda kind, names: f"attack.kind '{kind}' is unknown; choose one of: {names}")


def register_attack(spec: AttackSpec) -> AttackSpec:
    """Add ``spec`` under its name (a name taken fails)."""
    return _ATTACKS.register(spec.name, spec)


def unregister_attack(name: str) -> None:
    """Remove the attack registered as ``name``."""
    _ATTACKS.unregister(name)


def attack_names() -> tuple[str, ...]:
    """The registered attack kinds, built-ins first."""
    return _ATTACKS.names()


def attack_spec(kind: str) -> AttackSpec:
    """The attack registered as ``kind``."""
    return _ATTACKS.get(kind)


def check_attack(scenario: ServerScenario) -> None:
    """Fail at start when ``attack.fraction`` selects no client at all, or the attack's
    own rules refuse the scenario."""
    attack = AttackConfig(**dict(scenario.raw.get("attack") or {}))
    clients = scenario.federation.clients
    if attack.enabled and attack.num_attackers(clients) == 0:
        raise ValueError(f"attack.fraction {attack.fraction} of {clients} clients selects no "
                         f"attacker: raise it to at least {1 / clients:.3g} or set it to 0")
    if attack.enabled:
        for rule in attack_spec(attack.kind).rules:
            rule(scenario, attack)


def check_omniscient(scenario: ServerScenario, attack: AttackConfig) -> None:
    """An omniscient attack forges from the other updates of a round: someone must see them."""
    if scenario.secagg.enabled:
        raise ValueError(f"attack.kind = '{attack.kind}' forges updates from the other "
                         "clients' updates of the round, which no one sees under secure "
                         "aggregation: turn secagg off or pick another attack.kind")
    driver = scenario.driver
    if driver.kind != "sync" or driver.late_policy != "drop":
        raise ValueError(f"attack.kind = '{attack.kind}' forges updates from a synchronous "
                         "round's batch of honest updates: set driver.kind = 'sync' and "
                         "driver.late_policy = 'drop'")


def alie_z_max(n: int, m: int) -> float:
    """Baruch et al.'s z_max for ``m`` attackers among ``n``: the largest z with
    Phi(z) < (n - s) / n, where ``s = floor(n / 2 + 1) - m`` honest "supporters" are needed
    for a majority."""
    s = math.floor(n / 2 + 1) - m
    return statistics.NormalDist().inv_cdf((n - s) / n)


def alie(honest: np.ndarray, z: float) -> np.ndarray:
    """``mean - z * std`` per coordinate of the rows of ``honest`` (the sample standard
    deviation, ddof 1, as the bucketing paper's code; 0 for a single row)."""
    mean = honest.mean(axis=0, dtype=np.float64)
    std = honest.std(axis=0, ddof=1, dtype=np.float64) if honest.shape[0] > 1 else 0.0
    return (mean - z * std).astype(np.float32)


def ipm(honest: np.ndarray, epsilon: float) -> np.ndarray:
    """``-epsilon * mean`` of the rows of ``honest``."""
    return (-epsilon * honest.mean(axis=0, dtype=np.float64)).astype(np.float32)


def omniscient_attack(config: Mapping[str, Any]) -> Callable[[list[Update]], list[Update]] | None:
    """The pre-combine hook of an ``alie`` or ``ipm`` run (None for other attacks): each
    update whose metrics carry the attacker metric is replaced by the forged update,
    computed from the round's other (honest) updates; nothing changes without any."""
    attack = AttackConfig(**config.get("attack", {}))
    spec = attack_spec(attack.kind)
    if not attack.enabled or spec.forge is None:
        return None
    forge_one = spec.forge

    def forge(updates: list[Update]) -> list[Update]:
        bad = [i for i, u in enumerate(updates) if u.metrics.get(ATTACKER_METRIC)]
        honest = [u.delta for u in updates if not u.metrics.get(ATTACKER_METRIC)]
        if not bad or not honest:
            return updates
        forged = forge_one(np.stack(honest), len(updates), len(bad), attack)
        out = list(updates)
        for i in bad:
            out[i] = replace(updates[i], delta=forged.copy())
        return out

    return forge


# -- the transforms, each against its definition ------------------------------------------
def sign_flip(delta: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """``delta`` becomes ``-factor * delta`` (in place); returns it."""
    delta *= np.float32(-factor)
    return delta


def scale(delta: np.ndarray, factor: float) -> np.ndarray:
    """``delta`` becomes ``factor * delta`` (in place); returns it."""
    delta *= np.float32(factor)
    return delta


def gaussian_noise(delta: np.ndarray, std: float, rng: np.random.Generator,
                   mode: str = "replace") -> np.ndarray:
    """``delta`` replaced by (or, with ``mode="add"``, plus) N(0, std^2) noise, in place."""
    noise = rng.normal(0.0, std, size=delta.shape).astype(np.float32)
    if mode == "replace":
        delta[...] = noise
    elif mode == "add":
        delta += noise
    else:
        raise ValueError(f"noise mode must be one of {', '.join(NOISE_MODES)}, got {mode!r}")
    return delta


def flip_labels(y: torch.Tensor, num_classes: int, label_map: str = "reverse") -> torch.Tensor:
    """A new label tensor: ``num_classes - 1 - y`` ("reverse") or ``(y + 1) % num_classes``."""
    if label_map == "reverse":
        return (num_classes - 1) - y
    if label_map == "shift":
        return (y + 1) % num_classes
    raise ValueError(f"label map must be one of {', '.join(LABEL_MAPS)}, got {label_map!r}")


class Attack:
    """An ``[attack]`` bound to a run: who the attackers are and what they send."""

    def __init__(self, config: AttackConfig, *, seed: int, clients: int) -> None:
        self.config = config
        self.spec = attack_spec(config.kind)
        self.attackers = frozenset(choose_attackers(config.fraction, clients, seed))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None, *, seed: int,
                  clients: int) -> Attack | None:
        """The run's attack, or None when there is none."""
        config = AttackConfig(**(spec or {}))
        return cls(config, seed=seed, clients=clients) if config.enabled else None

    def is_attacker(self, partition_id: int) -> bool:
        return partition_id in self.attackers

    def labels(self, partition_id: int, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels this client trains on: permuted for a label-flipping attacker."""
        if self.spec.labels is not None and self.is_attacker(partition_id):
            return self.spec.labels(y, num_classes, self.config)
        return y

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        """Poison an attacker's ``delta`` in place (``seed``: its noise); True for attackers."""
        if not self.is_attacker(partition_id):
            return False
        if self.spec.tamper is not None:  # label_flip poisoned the labels; alie and ipm
            self.spec.tamper(delta, self.config, seed)  # are forged by omniscient_attack
        return True


def _forge_alie(honest: np.ndarray, n: int, m: int, c: AttackConfig) -> np.ndarray:
    return alie(honest, c.alie_z or alie_z_max(n, m))


for _spec in (
    AttackSpec("sign_flip", tamper=lambda delta, c, seed: sign_flip(delta, c.factor)),
    AttackSpec("scale", tamper=lambda delta, c, seed: scale(delta, c.scale)),
    AttackSpec("gaussian_noise", tamper=lambda delta, c, seed: gaussian_noise(
        delta, c.noise_std, np.random.default_rng(seed), c.noise_mode)),
    AttackSpec("label_flip", labels=lambda y, k, c: flip_labels(y, k, c.label_map)),
    AttackSpec("alie", forge=_forge_alie, rules=(check_omniscient,)),
    AttackSpec("ipm", forge=lambda honest, n, m, c: ipm(honest, c.ipm_epsilon),
               rules=(check_omniscient,)),
):
    register_attack(_spec)
