"""A driver, a combine and an attack are each one registration: toy ones, registered from
outside the packages, run in an in-process simulation and show their effect; unknown
names fail at start, naming the key and the registered names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from aggregation.registry import CombineSpec, register_combine, unregister_combine
from aggregation.robust import RobustCombine
from client.task import ATTACKER_METRIC
from server.drivers import DriverSpec, driver, driver_names, register_driver, unregister_driver
from server.scenario import ServerScenario
from server.store import Store
from simulations.attacks import AttackSpec, register_attack, unregister_attack
from simulations.cli import run_simulation
from simulations.config import load_scenario

SMALL = ["federation.clients=4", "federation.rounds=2", "train.local_epochs=1"]


# -- a toy driver: the sync driver's round source, wrapped to record its rounds ----------
class Recorded:
    """The sync round source, each round asked of it recorded in ``calls``."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self.inner, self.calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def next_round(self, run_id: str, rnd: int) -> Any:
        self.calls.append(rnd)
        return self.inner.next_round(run_id, rnd)


def _at_most_three_rounds(scenario: ServerScenario) -> None:
    if scenario.federation.rounds > 3:
        raise ValueError("driver.kind 'recorded' runs at most 3 rounds: set "
                         "federation.rounds <= 3")


@pytest.fixture
def recorded() -> Iterator[list[int]]:
    calls: list[int] = []
    register_driver(DriverSpec(
        "recorded", lambda ctx, secure: Recorded(driver("sync").build(ctx, secure), calls),
        rules=(_at_most_three_rounds,)))
    yield calls
    unregister_driver("recorded")


def test_a_driver_registered_from_outside_runs_and_its_rules_apply(recorded, tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    summary = run_simulation(load_scenario("default", [*SMALL, "driver.kind=recorded"]),
                             engine="inprocess", db=db)
    assert recorded == [1, 2]  # its round source ran every round
    assert summary["driver"] == "recorded"
    with Store(db) as store:
        rounds = {r.round: (r.status, r.num_accepted) for r in store.rounds(summary["run_id"])}
    assert rounds[1] == rounds[2] == ("completed", 4)
    with pytest.raises(ValueError, match="'recorded' runs at most 3 rounds"):
        load_scenario("default", [*SMALL, "driver.kind=recorded", "federation.rounds=4"])


# -- a toy combine: the first update ------------------------------------------------------
class First(RobustCombine):
    """Takes the first update added, as it is; each aggregation's rows go to ``seen``."""

    seen: ClassVar[list[np.ndarray]] = []

    def _combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        First.seen.append(x.copy())
        return x[0].copy()


def _uniform_weights(scenario: ServerScenario) -> None:
    if scenario.aggregation.weight_by != "uniform":
        raise ValueError("aggregation.combine 'first' ignores the weights: set "
                         "aggregation.weight_by = 'uniform'")


@pytest.fixture
def first() -> Iterator[list[np.ndarray]]:
    First.seen = []
    register_combine(CombineSpec("first", First, rules=(_uniform_weights,)))
    yield First.seen
    unregister_combine("first")


def test_a_combine_registered_from_outside_aggregates_the_rounds(first, run_inprocess):
    models: list[np.ndarray] = []
    config = load_scenario("default", [*SMALL, "aggregation.combine=first",
                                       "aggregation.weight_by=uniform"])
    run_inprocess(config, models=models)
    assert len(first) == 2 and all(len(rows) == 4 for rows in first)  # 4 clients a round
    for rnd, rows in enumerate(first):  # FedAvg with lr 1 applies the first update as is
        np.testing.assert_allclose(models[rnd + 1], models[rnd] + rows[0], rtol=0, atol=1e-6)
        assert not np.allclose(models[rnd + 1], models[rnd] + rows.mean(axis=0), atol=1e-6)
    with pytest.raises(ValueError, match="'first' ignores the weights"):  # its rule
        load_scenario("default", [*SMALL, "aggregation.combine=first"])


# -- a toy attack: the attackers send zeros -----------------------------------------------
@pytest.fixture
def zero() -> Iterator[None]:
    register_attack(AttackSpec("zero", tamper=lambda delta, config, seed: delta.fill(0)))
    yield
    unregister_attack("zero")


def test_an_attack_registered_from_outside_tampers_with_the_attackers_updates(zero, tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    summary = run_simulation(load_scenario("default", [*SMALL, "attack.kind=zero",
                                                       "attack.fraction=0.5"]),
                             engine="inprocess", db=db)
    with Store(db) as store:
        records = [r for _, r in store.updates(summary["run_id"])]
    attackers = [r for r in records if r.metrics.get(ATTACKER_METRIC)]
    honest = [r for r in records if not r.metrics.get(ATTACKER_METRIC)]
    assert len(attackers) == len(honest) == 4  # 2 of 4 clients, 2 rounds
    assert all(r.norm == 0 for r in attackers)
    assert all(r.norm is not None and r.norm > 0 for r in honest)


# -- unknown names ------------------------------------------------------------------------
@pytest.mark.parametrize("key, names", [
    ("driver.kind", "sync, fedasync, fedbuff, cross_silo, gossip, recorded"),
    ("aggregation.combine", "mean, sum, median, trimmed_mean, krum, multikrum, bulyan, "
                            "centered_clip, geometric_median, first"),
    ("attack.kind", "sign_flip, scale, gaussian_noise, label_flip, alie, ipm, zero"),
])
def test_an_unknown_name_fails_at_start_naming_the_key_and_the_registered_ones(
        recorded, first, zero, key, names):
    message = f"{key} 'nope' is unknown; choose one of: {names}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        load_scenario("default", [*SMALL, f"{key}=nope"])


def test_unregistered_names_are_unknown_again_and_a_name_registers_once(recorded):
    with pytest.raises(ValueError, match="already registered"):
        register_driver(DriverSpec("recorded", lambda ctx, secure: None))
    with pytest.raises(ValueError, match="already registered"):
        register_combine(CombineSpec("median", First))
    unregister_driver("recorded")
    try:
        assert "recorded" not in driver_names()
        with pytest.raises(ValueError, match=re.escape("driver.kind 'recorded' is unknown")):
            load_scenario("default", [*SMALL, "driver.kind=recorded"])
    finally:
        register_driver(DriverSpec("recorded", lambda ctx, secure: None))  # for the teardown


# -- the mechanism the three registries share ---------------------------------------------
def test_a_registry_loads_its_built_ins_once_on_first_use_and_again_after_a_failure():
    from aggregation.registry import Registry

    loads: list[int] = []

    def load() -> None:
        loads.append(1)
        if len(loads) == 1:
            raise RuntimeError("the built-ins failed to import")
        registry.register("builtin", 1)

    registry: Registry[int] = Registry("thing", lambda kind, names: f"no {kind} in {names}",
                                       load=load)
    with pytest.raises(RuntimeError):
        registry.names()
    assert registry.names() == ("builtin",) and registry.get("builtin") == 1
    registry.register("extra", 2)
    assert registry.names() == ("builtin", "extra") and len(loads) == 2
    with pytest.raises(ValueError, match=r"^no other in builtin, extra$"):
        registry.get("other")


def test_a_registry_refuses_a_taken_or_reserved_name_and_forgets_an_unregistered_one():
    from aggregation.registry import Registry

    registry: Registry[str] = Registry("combine", lambda kind, names: kind, reserved=("mean",))
    registry.register("first", "a")
    for taken in ("first", "mean"):
        with pytest.raises(ValueError, match=rf"^combine '{taken}' is already registered$"):
            registry.register(taken, "b")
    assert registry.get("first") == "a"
    registry.unregister("first")
    assert registry.names() == ()
    with pytest.raises(ValueError):
        registry.get("first")
