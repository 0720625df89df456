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

from aggregation.registry import Registry

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


_DRIVERS: Registry[DriverSpec] = Registry(
    "driver", lambda kind, names: f"driver.kind '{kind}' is unknown; choose one of: {names}",
    load=lambda: importlib.import_module(BUILTINS))


def register_driver(spec: DriverSpec) -> DriverSpec:
    """Add ``spec`` under its name (a name taken fails)."""
    return _DRIVERS.register(spec.name, spec)


def unregister_driver(name: str) -> None:
    """Remove the driver registered as ``name``."""
    _DRIVERS.unregister(name)


def driver_names() -> tuple[str, ...]:
    """The registered drivers' names, built-ins first."""
    return _DRIVERS.names()


def driver(kind: str) -> DriverSpec:
    """The driver registered as ``kind``."""
    return _DRIVERS.get(kind)
