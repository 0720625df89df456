"""The robust combines by name: a registry of :class:`CombineSpec` entries.

A scenario's ``aggregation.combine`` names ``mean``, ``sum`` or one registered combine.
Each entry declares its builder, the parameters it takes, how they are read from the
``[aggregation]`` section and its cross-section rules; :func:`register_combine` adds one
(the built-ins below use it, a combine from outside the package is one more call), and
:func:`make_robust_combine` builds one by name. The sorting and distance-based combines
live in :mod:`aggregation.robust`, centered clipping and the geometric median in
:mod:`aggregation.centered`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aggregation.centered import CenteredClip, GeometricMedian
from aggregation.combine import Combine
from aggregation.robust import Bulyan, CoordinateMedian, Krum, MultiKrum, TrimmedMean

__all__ = ["ROBUST_KINDS", "CombineSpec", "combine_spec", "make_robust_combine",
           "register_combine", "robust_kinds", "unregister_combine"]

# A cross-section rule: takes the typed scenario (``server.scenario.ServerScenario``),
# raises ValueError naming the key to change.
Rule = Callable[[Any], None]


def _no_params(aggregation: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class CombineSpec:
    """One robust combine: ``build(**params)`` makes it; ``required`` and ``optional``
    name the parameters it takes; ``params(aggregation)`` reads them from the
    ``[aggregation]`` section (``server.config.AggregationConfig``); ``rules`` are its
    cross-section checks on the typed scenario, run at start."""

    name: str
    build: Callable[..., Combine]
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    params: Callable[[Any], dict[str, Any]] = _no_params
    rules: tuple[Rule, ...] = ()


_COMBINES: dict[str, CombineSpec] = {}


def register_combine(spec: CombineSpec) -> CombineSpec:
    """Add ``spec`` under its name (a name taken, ``mean`` and ``sum`` included, fails)."""
    if spec.name in _COMBINES or spec.name in ("mean", "sum"):
        raise ValueError(f"combine '{spec.name}' is already registered")
    _COMBINES[spec.name] = spec
    return spec


def unregister_combine(name: str) -> None:
    """Remove the combine registered as ``name``."""
    del _COMBINES[name]


def robust_kinds() -> tuple[str, ...]:
    """The names of the registered robust combines, in registration order."""
    return tuple(_COMBINES)


def combine_spec(kind: str) -> CombineSpec:
    """The entry registered as ``kind``."""
    if kind not in _COMBINES:
        raise ValueError(f"unknown robust combine '{kind}'; choose one of: "
                         f"{', '.join(_COMBINES)}")
    return _COMBINES[kind]


def make_robust_combine(kind: str, **params: Any) -> Combine:
    """Build a robust combine by name: median, trimmed_mean(beta), krum(f),
    multikrum(f, m=None), bulyan(f, selection="iterated"), centered_clip(radius=0,
    iterations=3, f=0, scale=1, late_iterations=None, late_after=0),
    geometric_median(nu=1e-6, iterations=8, f=0), or one registered later."""
    spec = combine_spec(kind)
    unknown = sorted(set(params) - set(spec.required) - set(spec.optional))
    if unknown:
        allowed = ", ".join(spec.required + spec.optional) or "none"
        raise ValueError(f"combine '{kind}' got unknown parameters {unknown}; "
                         f"it takes: {allowed}")
    missing = [p for p in spec.required if p not in params]
    if missing:
        raise ValueError(f"combine '{kind}' needs parameters {missing}")
    return spec.build(**params)


for _spec in (
    CombineSpec("median", CoordinateMedian),
    CombineSpec("trimmed_mean", TrimmedMean, ("beta",),
                params=lambda a: {"beta": a.trim_beta}),
    CombineSpec("krum", Krum, ("f",), params=lambda a: {"f": a.f}),
    CombineSpec("multikrum", MultiKrum, ("f",), ("m",),
                params=lambda a: {"f": a.f, "m": a.multikrum_m or None}),
    CombineSpec("bulyan", Bulyan, ("f",), ("selection",),
                params=lambda a: {"f": a.f, "selection": a.bulyan_selection}),
    CombineSpec("centered_clip", CenteredClip, (),
                ("radius", "iterations", "f", "scale", "late_iterations", "late_after"),
                params=lambda a: {"radius": a.clip_radius, "iterations": a.clip_iterations,
                                  "f": a.f, "scale": a.clip_scale,
                                  "late_iterations": a.clip_iterations_late or None,
                                  "late_after": a.clip_late_after}),
    CombineSpec("geometric_median", GeometricMedian, (), ("nu", "iterations", "f"),
                params=lambda a: {"nu": a.gm_nu, "iterations": a.gm_iterations, "f": a.f}),
):
    register_combine(_spec)

ROBUST_KINDS: tuple[str, ...] = robust_kinds()  # the built-in ones; robust_kinds(): all now
