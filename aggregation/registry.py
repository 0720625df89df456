"""Entries by name (:class:`Registry`), and the robust combines' registry of
:class:`CombineSpec` entries.

:class:`Registry` is the one mechanism behind every "kind by name" of a scenario: the
combines here, the drivers (``server.drivers``) and the attacks (``simulations.attacks``).
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
from typing import Any, Generic, TypeVar

from aggregation.centered import CenteredClip, GeometricMedian
from aggregation.combine import Combine
from aggregation.robust import Bulyan, CoordinateMedian, Krum, MultiKrum, TrimmedMean

__all__ = ["ROBUST_KINDS", "CombineSpec", "Registry", "combine_spec", "make_robust_combine",
           "register_combine", "robust_kinds", "unregister_combine"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    ``label`` names the kind in "already registered"; ``unknown(kind, names)`` is the
    message for a name not registered (``names``: the registered ones, comma-separated);
    ``reserved``: names that are not entries but may not be taken; ``load``: called once,
    on the first use, to register the built-in entries (a module imported by name, so
    that the registry itself imports none of them).
    """

    def __init__(self, label: str, unknown: Callable[[str, str], str], *,
                 reserved: tuple[str, ...] = (), load: Callable[[], object] | None = None) -> None:
        self.label = label
        self._unknown = unknown
        self._reserved = reserved
        self._load = load
        self._entries: dict[str, T] = {}

    def _all(self) -> dict[str, T]:
        if self._load is not None:
            load, self._load = self._load, None
            try:
                load()
            except BaseException:
                self._load = load  # try again on the next use
                raise
        return self._entries

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` as ``name`` (ValueError when the name is taken)."""
        if name in self._all() or name in self._reserved:
            raise ValueError(f"{self.label} '{name}' is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        del self._all()[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._all())

    def get(self, name: str) -> T:
        """The entry registered as ``name`` (ValueError with ``unknown``'s message)."""
        entries = self._all()
        if name not in entries:
            raise ValueError(self._unknown(name, ", ".join(entries)))
        return entries[name]

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


_COMBINES: Registry[CombineSpec] = Registry(
    "combine", lambda kind, names: f"unknown robust combine '{kind}'; choose one of: {names}",
    reserved=("mean", "sum"))


def register_combine(spec: CombineSpec) -> CombineSpec:
    """Add ``spec`` under its name (a name taken, ``mean`` and ``sum`` included, fails)."""
    return _COMBINES.register(spec.name, spec)


def unregister_combine(name: str) -> None:
    """Remove the combine registered as ``name``."""
    _COMBINES.unregister(name)


def robust_kinds() -> tuple[str, ...]:
    """The names of the registered robust combines, in registration order."""
    return _COMBINES.names()


def combine_spec(kind: str) -> CombineSpec:
    """The entry registered as ``kind``."""
    return _COMBINES.get(kind)


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


def _arc_sees_updates(scenario: Any) -> None:
    """Adaptive robust clipping ranks individual updates, which secagg hides."""
    if scenario.aggregation.arc and scenario.secagg.enabled:
        raise ValueError("aggregation.arc clips the largest individual updates, which the "
                         "server never sees under secagg (it learns only the sum): set "
                         "aggregation.arc = false")


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
                                  "late_after": a.clip_late_after},
                 rules=(_arc_sees_updates,)),
    CombineSpec("geometric_median", GeometricMedian, (), ("nu", "iterations", "f"),
                params=lambda a: {"nu": a.gm_nu, "iterations": a.gm_iterations, "f": a.f}),
):
    register_combine(_spec)

ROBUST_KINDS: tuple[str, ...] = robust_kinds()  # the built-in ones; robust_kinds(): all now
