"""What the store accepts and returns: update fates, run and round views, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

import numpy as np

RUN_STATUSES = ("running", "completed", "failed", "stopped")
FINAL_RUN_STATUSES = ("completed", "failed", "stopped")
ROUND_STATUSES = ("completed", "aborted", "failed")
FATES = ("accepted", "rejected", "dropped")

_R = TypeVar("_R")


@dataclass(frozen=True)
class UpdateRecord:
    """The fate of one client update in one round."""

    client_id: str
    fate: str  # "accepted" | "rejected" | "dropped"
    reason: str | None = None
    num_examples: int | None = None
    base_version: int | None = None
    staleness: int | None = None
    norm: float | None = None
    weight: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fate not in FATES:
            raise ValueError(
                f"update fate {self.fate!r} of client {self.client_id!r}: "
                f"must be one of {', '.join(FATES)}"
            )


@dataclass(frozen=True)
class EvalRecord:
    """One client's answer in a federated evaluation round: its figures for the global
    model on its held-out split (and for its own model, where that differs), or why there
    are none (rejected with a reason, or dropped)."""

    client_id: str
    fate: str  # "accepted" | "rejected" | "dropped"
    reason: str | None = None
    num_examples: int | None = None
    loss: float | None = None
    accuracy: float | None = None
    loss_personal: float | None = None
    accuracy_personal: float | None = None

    def __post_init__(self) -> None:
        if self.fate not in FATES:
            raise ValueError(f"evaluation fate {self.fate!r} of client {self.client_id!r}: "
                             f"must be one of {', '.join(FATES)}")


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    name: str | None
    status: str
    seed: int
    created_at: datetime
    finished_at: datetime | None
    config: dict
    summary: dict | None
    num_rounds: int  # training rounds recorded so far (not round 0, the initial model's)


@dataclass(frozen=True)
class RoundInfo:
    round: int
    model_version: int
    status: str
    num_sampled: int
    num_replies: int
    num_accepted: int
    num_rejected: int
    num_dropped: int
    metrics: dict[str, float]
    wall_s: float
    started_at: datetime | None = None


@dataclass(frozen=True)
class Checkpoint:
    round: int
    model_version: int
    params: np.ndarray  # flat float32
    state: dict
    sha256: str


def from_row(cls: type[_R], row: Any, **converted: Any) -> _R:
    """Dataclass ``cls`` from an ORM ``row``: each field from the column of its name, except
    those given in ``converted`` (values decoded from JSON, or not columns at all)."""
    columns = {f.name: getattr(row, f.name) for f in fields(cls) if f.name not in converted}
    return cls(**columns, **converted)


def row_dict(row: Any, **converted: Any) -> dict[str, Any]:
    """A one-row-per-round table's ``row`` as a dict of its columns but ``id`` and
    ``run_id``, in table order; ``converted`` replaces decoded values."""
    return {c.key: converted[c.key] if c.key in converted else getattr(row, c.key)
            for c in row.__table__.columns if c.key not in ("id", "run_id")}
