"""The robust combines by name: what each takes, and :func:`make_robust_combine`.

The sorting and distance-based combines live in :mod:`aggregation.robust`, centered
clipping and the geometric median in :mod:`aggregation.centered`; a scenario's
``aggregation.combine`` names one of :data:`ROBUST_KINDS`.
"""

from __future__ import annotations

from typing import Any

from aggregation.centered import CenteredClip, GeometricMedian
from aggregation.robust import Bulyan, CoordinateMedian, Krum, MultiKrum, RobustCombine, TrimmedMean

__all__ = ["ROBUST_KINDS", "make_robust_combine"]

_FACTORIES: dict[str, tuple[type[RobustCombine], tuple[str, ...], tuple[str, ...]]] = {
    # kind: (class, required parameters, optional parameters)
    "median": (CoordinateMedian, (), ()),
    "trimmed_mean": (TrimmedMean, ("beta",), ()),
    "krum": (Krum, ("f",), ()),
    "multikrum": (MultiKrum, ("f",), ("m",)),
    "bulyan": (Bulyan, ("f",), ("selection",)),
    "centered_clip": (CenteredClip, (), ("radius", "iterations", "f", "scale",
                                         "late_iterations", "late_after")),
    "geometric_median": (GeometricMedian, (), ("nu", "iterations", "f")),
}
ROBUST_KINDS: tuple[str, ...] = tuple(_FACTORIES)


def make_robust_combine(kind: str, **params: Any) -> RobustCombine:
    """Build a robust combine by name: median, trimmed_mean(beta), krum(f),
    multikrum(f, m=None), bulyan(f, selection="iterated"), centered_clip(radius=0,
    iterations=3, f=0, scale=1, late_iterations=None, late_after=0),
    geometric_median(nu=1e-6, iterations=8, f=0)."""
    if kind not in ROBUST_KINDS:
        raise ValueError(f"unknown robust combine '{kind}'; choose one of: "
                         f"{', '.join(ROBUST_KINDS)}")
    cls, required, optional = _FACTORIES[kind]
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join(required + optional) or "none"
        raise ValueError(f"combine '{kind}' got unknown parameters {unknown}; "
                         f"it takes: {allowed}")
    missing = [p for p in required if p not in params]
    if missing:
        raise ValueError(f"combine '{kind}' needs parameters {missing}")
    return cls(**params)
