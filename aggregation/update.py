"""What a client returns and what the server decides about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass
class Update:
    """A client's model delta ``w_local - w_base``, never raw weights."""

    client_id: str
    delta: np.ndarray
    num_examples: int
    base_version: int
    metrics: dict[str, float] = field(default_factory=dict)


class Verdict(NamedTuple):
    """The fate of one update in one aggregation: accepted with a weight, or rejected.

    Immutable, and a tuple so that it is cheap to build once per update.
    """

    client_id: str
    accepted: bool
    reason: str | None = None
    num_examples: int | None = None
    base_version: int | None = None
    staleness: int | None = None
    norm: float | None = None
    weight: float | None = None


class Rejected(Exception):
    """Raised by a per-update stage to reject an update; the message is the stored reason."""

    @property
    def reason(self) -> str:
        return str(self.args[0]) if self.args else "rejected"
