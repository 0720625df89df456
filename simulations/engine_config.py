"""The ``[engine]`` section: how the simulation engine runs the clients.

``vectorize`` (the in-process engine): train a round's clients as one batched
computation (``client.cohort``) when they share the model and optimizer: ``false``
(the default: one client after the other), ``"auto"`` (cohorts of two or more clients
that can be vectorized and whose stacked parameters fit one batch,
``client.vectorized.STACK_BUDGET``; the others go one by one, with one log line per
reason) or ``true`` (every cohort that can be, in batches that fit, with a warning per
reason when one cannot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VECTORIZE_CHOICES = ("auto", True, False)


@dataclass(frozen=True)
class EngineConfig:
    """``[engine]``: settings of the engine that runs the clients."""

    # A factory, not a plain default, so that the section accepts a string or a bool.
    vectorize: Any = field(default_factory=lambda: False)

    def __post_init__(self) -> None:
        if not any(self.vectorize is c or self.vectorize == c for c in VECTORIZE_CHOICES
                   if type(c) is type(self.vectorize)):
            raise ValueError(f"engine.vectorize must be \"auto\", true or false, got "
                             f"{self.vectorize!r}")
