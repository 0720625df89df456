"""Learners inside a silo: the train config keys that carry ``silo.learners`` and SMA.

Silo rounds (cross-silo, secure cross-silo, gossip) add these keys to every training
message's ConfigRecord when ``silo.learners`` > 1; a message without them asks for one
replica per process (DDP). ``client.silo.learners`` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord

from client.protocol.errors import WireError
from client.protocol.names import Names


class LearnerKey(Names):
    """Keys of the train ConfigRecord for learners with synchronous model averaging."""

    LEARNERS = "fedring.silo-learners"  # replicas per silo process
    MOMENTUM = "fedring.sma-momentum"  # mu: the average model's momentum
    CORRECTION = "fedring.sma-correction"  # alpha: each learner's step towards the average


@dataclass(frozen=True)
class LearnerSpec:
    """``learners`` replicas per process, synchronised by SMA (``momentum``, ``correction``;
    a ``correction`` of None is "auto": 1 / the silo's learners, :meth:`alpha`)."""

    learners: int = 1
    momentum: float = 0.0
    correction: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.learners, bool) or not isinstance(self.learners, int) \
                or self.learners < 1:
            raise ValueError(f"silo.learners must be an integer >= 1, got {self.learners!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"silo.sma_momentum must be in [0, 1), got {self.momentum!r}")
        if self.correction is not None and not 0 < self.correction <= 1 / self.learners:
            raise ValueError(f"silo.sma_correction must be in (0, 1 / silo.learners] = "
                             f"(0, {1 / self.learners:.4g}], got {self.correction!r}: the "
                             "average model moves by the sum of the learners' corrections, "
                             "and above that it overshoots their mean")

    def alpha(self, processes: int) -> float:
        """Each learner's step towards the average model in a silo of ``processes``
        processes: ``correction``, or under "auto" 1 / (processes x learners), which moves
        the average model to the learners' mean (Crossbow's 1/L)."""
        if self.correction is not None:
            return self.correction
        return 1.0 / (processes * self.learners)

    def config(self) -> dict[str, Any]:
        """The keys a training message carries (none for one learner: DDP; no correction
        under "auto")."""
        if self.learners == 1:
            return {}
        keys: dict[str, Any] = {LearnerKey.LEARNERS: self.learners,
                                LearnerKey.MOMENTUM: self.momentum}
        if self.correction is not None:
            keys[LearnerKey.CORRECTION] = self.correction
        return keys

    def refusal(self, train: Mapping[str, Any]) -> str | None:
        """Why the ``[train]`` settings ``train`` cannot run with these learners, or None."""
        if self.learners == 1:
            return None
        if float(train.get("dp_sgd_noise_multiplier", 0.0)) > 0:
            return ("DP-SGD (train.dp_sgd_noise_multiplier > 0) is not supported with "
                    "silo.learners > 1: set silo.learners = 1")
        if float(train.get("proximal_mu", 0.0)) > 0:
            return ("FedProx (train.proximal_mu > 0) is not supported with silo.learners > 1: "
                    "set train.proximal_mu = 0 or silo.learners = 1")
        optimizer = train.get("optimizer", "sgd")
        if optimizer != "sgd":
            return (f"silo.learners > 1 trains with SGD, got train.optimizer = '{optimizer}': "
                    "set train.optimizer = 'sgd' or silo.learners = 1")
        return None

    @classmethod
    def of(cls, config: ConfigRecord) -> LearnerSpec:
        """The spec a training message's config asks for (one learner when it says none)."""
        if LearnerKey.LEARNERS not in config:
            return cls()
        try:
            return cls(learners=config[LearnerKey.LEARNERS],  # type: ignore[arg-type]
                       momentum=float(config[LearnerKey.MOMENTUM]),  # type: ignore[arg-type]
                       correction=(float(config[LearnerKey.CORRECTION])  # type: ignore[arg-type]
                                   if LearnerKey.CORRECTION in config else None))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"bad learner keys in the train config: {exc}") from None
