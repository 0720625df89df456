"""Drivers by name: the registry ``[driver] kind`` is checked against.

A *driver* is what ``[driver] kind`` names, an entry of this registry; the *round
source* is the object it builds for one run (``server.rounds.RoundSource``), which
``server.run_loop.RunLoop`` drives. Each entry, a :class:`DriverSpec`, declares its name,
its own section's config class if it has one, its rules (cross-section checks on the
typed scenario, run by ``server.settings_checks.check_settings``) and its builder.
:func:`register_driver` adds one: a driver from outside the package is one module and one
call. The built-in drivers (sync, fedasync, fedbuff, cross_silo, gossip) are registered
by ``server.builtin_drivers``, loaded on the first look-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DriverSpec", "driver", "driver_names", "register_driver", "unregister_driver"]

BUILTINS = "server.builtin_drivers"  # registers the built-in drivers when imported

# A cross-section rule: takes the typed scenario (``server.scenario.ServerScenario``),
# raises ValueError naming the key to change.
Rule = Callable[[Any], None]
# Builds the round source of one run: (``server.rounds.RunContext``, the run's secure
# aggregation or None) -> ``server.rounds.RoundSource``.
Builder = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class DriverSpec:
    """One driver.

    ``build(ctx, secure)`` makes the run's round source; ``section``: the config class of
    the driver's own section (e.g. ``[silo]``), None if it has none; ``rules``: its
    cross-section checks, in order, after the ``[dp]`` rules; ``early_rules``: those run
    before the ``[dp]`` rules, so that the driver's message says why it refuses a setting
    first (gossip's: it has no global model). ``asynchronous``: it takes every update that
    arrives and counts model versions (FedAsync, FedBuff); ``silos``: its rounds run among
    silos that must all run at once; ``secure``: it runs under secure aggregation;
    ``secure_evaluation``: its clients answer a secure federated evaluation.
    """

    name: str
    build: Builder
    section: type | None = None
    rules: tuple[Rule, ...] = ()
    early_rules: tuple[Rule, ...] = ()
    asynchronous: bool = False
    silos: bool = False
    secure: bool = False
    secure_evaluation: bool = False


_DRIVERS: dict[str, DriverSpec] = {}
_loaded = False


def _builtins() -> dict[str, DriverSpec]:
    """The registry, with the built-in drivers registered (once, on the first call)."""
    global _loaded
    if not _loaded:
        _loaded = True
        try:
            importlib.import_module(BUILTINS)
        except BaseException:
            _loaded = False
            raise
    return _DRIVERS


def register_driver(spec: DriverSpec) -> DriverSpec:
    """Add ``spec`` under its name (a name taken fails)."""
    if spec.name in _builtins():
        raise ValueError(f"driver '{spec.name}' is already registered")
    _DRIVERS[spec.name] = spec
    return spec


def unregister_driver(name: str) -> None:
    """Remove the driver registered as ``name``."""
    del _builtins()[name]


def driver_names() -> tuple[str, ...]:
    """The registered drivers' names, built-ins first."""
    return tuple(_builtins())


def driver(kind: str) -> DriverSpec:
    """The driver registered as ``kind``."""
    drivers = _builtins()
    if kind not in drivers:
        raise ValueError(f"driver.kind '{kind}' is unknown; choose one of: "
                         f"{', '.join(drivers)}")
    return drivers[kind]
