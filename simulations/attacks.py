"""Simulated attacks: a fraction of the clients send poisoned updates (``[attack]``).

The attackers are partition ids drawn from the run seed, so every engine and every
resumed run sees the same ones. What they do is ``kind``:

- ``sign_flip``: send ``-factor * delta`` (model poisoning);
- ``scale``: send ``scale * delta``;
- ``gaussian_noise``: send N(0, noise_std^2) noise instead of the delta
  (``noise_mode = "replace"``) or added to it (``"add"``);
- ``label_flip``: train honestly on permuted labels (data poisoning): ``label_map =
  "reverse"`` maps y to num_classes - 1 - y, ``"shift"`` maps y to (y + 1) mod num_classes.

Attacks exist in simulations only: the scenario task hands them to the ClientApp, which
applies them to an attacker's delta just before it replies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ATTACK_KINDS = ("sign_flip", "scale", "gaussian_noise", "label_flip")
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

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"attack.fraction must be in [0, 1] (the share of clients that "
                             f"attack; 0: none), got {self.fraction}")
        if self.kind not in ATTACK_KINDS:
            raise ValueError(f"attack.kind '{self.kind}' is unknown; choose one of: "
                             f"{', '.join(ATTACK_KINDS)}")
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


def check_attack(config: Mapping[str, Any]) -> None:
    """Fail at start when ``attack.fraction`` selects no client at all."""
    attack = AttackConfig(**config["attack"])
    clients = int(config["federation"]["clients"])
    if attack.enabled and attack.num_attackers(clients) == 0:
        raise ValueError(f"attack.fraction {attack.fraction} of {clients} clients selects no "
                         f"attacker: raise it to at least {1 / clients:.3g} or set it to 0")


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
        if self.config.kind == "label_flip" and self.is_attacker(partition_id):
            return flip_labels(y, num_classes, self.config.label_map)
        return y

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        """Poison an attacker's ``delta`` in place (``seed``: its noise); True for attackers."""
        if not self.is_attacker(partition_id):
            return False
        c = self.config
        if c.kind == "sign_flip":
            sign_flip(delta, c.factor)
        elif c.kind == "scale":
            scale(delta, c.scale)
        elif c.kind == "gaussian_noise":
            gaussian_noise(delta, c.noise_std, np.random.default_rng(seed), c.noise_mode)
        return True  # label_flip poisoned the labels, not the delta
