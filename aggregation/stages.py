"""Per-update stages: validation, clipping and weighting.

A stage looks at one :class:`Candidate` and either lets it through (possibly with a
clipped delta or a weight) or raises :class:`Rejected` with the reason to store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.linalg.blas import sdot

from aggregation.staleness import Constant, StalenessFn
from aggregation.update import Rejected, Update

MAX_COUNT = 2**63 - 1  # num_examples must fit an int64 (and so a finite float32 weight)


@dataclass
class Candidate:
    """An update on its way through the per-update stages of one aggregation."""

    update: Update
    staleness: int
    norm: float | None = None
    weight: float = 1.0

    @property
    def delta(self) -> np.ndarray:
        return self.update.delta

    def l2_norm(self) -> float:
        """The delta's L2 norm, computed once (one BLAS pass, in float32 like the delta)."""
        if self.norm is None:
            d = self.update.delta
            flat32 = d.dtype == np.float32 and d.ndim == 1 and d.size
            # scipy's sdot is np.dot without numpy's dispatch (half its cost at 10k floats); a
            # strided delta is copied by the wrapper, so every float32 vector sums the same way
            self.norm = math.sqrt(float(sdot(d, d) if flat32 else np.dot(d, d)))
        return self.norm


class UpdateStage:
    """Base class of per-update stages."""

    def process(self, c: Candidate, dim: int, version: int) -> None:
        raise NotImplementedError


@dataclass
class Validate(UpdateStage):
    """Reject updates of the wrong shape or dtype, with NaN/Inf, bad counts or versions.

    ``max_norm`` bounds the L2 norm (None: no bound); ``max_staleness`` bounds
    ``version - base_version`` (None: no bound, the stale-synchronous bound otherwise).
    """

    max_norm: float | None = None
    max_staleness: int | None = None

    def process(self, c: Candidate, dim: int, version: int) -> None:
        u = c.update
        d = u.delta
        if not isinstance(d, np.ndarray):
            raise Rejected(f"delta is {type(d).__name__}, expected a numpy array")
        if d.dtype != np.float32:
            raise Rejected(f"delta dtype is {d.dtype}, expected float32")
        if d.shape != (dim,):
            raise Rejected(f"delta shape is {d.shape}, expected ({dim},)")
        n = u.num_examples
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
            raise Rejected(f"num_examples must be a positive integer, got {n!r}")
        if n > MAX_COUNT:
            raise Rejected("num_examples does not fit an int64")
        b = u.base_version
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 0:
            raise Rejected(f"base_version must be a non-negative integer, got {b!r}")
        if b > version:
            raise Rejected(f"base_version {b} is newer than the server model version {version}")
        if self.max_staleness is not None and c.staleness > self.max_staleness:
            raise Rejected(f"staleness {c.staleness} exceeds max_staleness {self.max_staleness}")
        norm = c.l2_norm()
        if not math.isfinite(norm):
            bad = int(np.count_nonzero(~np.isfinite(d)))
            raise Rejected(f"delta has {bad} NaN/Inf values" if bad else
                           "delta norm overflows float32")
        if self.max_norm is not None and norm > self.max_norm:
            raise Rejected(f"delta norm {norm:.4g} exceeds max_norm {self.max_norm:.4g}")


@dataclass
class Clip(UpdateStage):
    """Scale the delta into the L2 ball of radius ``clip`` (before weighting)."""

    clip: float

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")

    def process(self, c: Candidate, dim: int, version: int) -> None:
        norm = c.l2_norm()
        if norm > self.clip:
            c.update.delta = c.update.delta * np.float32(self.clip / norm)
            c.norm = self.clip


@dataclass
class Weight(UpdateStage):
    """Weight by example count ("examples") or equally ("uniform"), times s(staleness)."""

    by: str = "examples"
    staleness: StalenessFn = field(default_factory=Constant)

    def __post_init__(self) -> None:
        if self.by not in ("examples", "uniform"):
            raise ValueError(f"weight by must be 'examples' or 'uniform', got '{self.by}'")

    def process(self, c: Candidate, dim: int, version: int) -> None:
        base = float(c.update.num_examples) if self.by == "examples" else 1.0
        c.weight = base * self.staleness(c.staleness)
        if not c.weight > 0:
            raise Rejected(f"weight {c.weight} is not positive")
