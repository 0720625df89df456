"""The [driver] and [clients] sections: defaults, bad values, cross-section rules."""

from __future__ import annotations

import pytest

from aggregation import Validate, Weight
from server.config import AggregationConfig
from server.driver_config import ClientsConfig, DriverConfig
from simulations.config import load_scenario


def test_defaults_resolve_and_are_stored_in_the_config():
    cfg = load_scenario("default")
    assert cfg["driver"]["kind"] == "sync" and cfg["driver"]["late_policy"] == "drop"
    assert cfg["clients"]["straggler_fraction"] == 0.0
    assert DriverConfig(**cfg["driver"]) == DriverConfig()
    assert ClientsConfig(**cfg["clients"]) == ClientsConfig()


def test_driver_staleness_reaches_the_aggregation_pipeline():
    cfg = load_scenario("default", ["driver.kind=fedbuff", "driver.staleness=hinge",
                                    "driver.staleness_a=2.0", "driver.staleness_b=3",
                                    "driver.max_staleness=7"])
    assert cfg["driver"]["staleness"] == "hinge"
    assert (cfg["driver"]["staleness_a"], cfg["driver"]["staleness_b"]) == (2.0, 3)
    assert "staleness" not in cfg["aggregation"]  # each key lives in one section
    driver = DriverConfig(**cfg["driver"])
    pipeline = AggregationConfig(**cfg["aggregation"]).build(
        staleness=driver.staleness_config())
    weight = next(s for s in pipeline.update_stages if isinstance(s, Weight))
    validate = next(s for s in pipeline.update_stages if isinstance(s, Validate))
    assert weight.staleness(5) == pytest.approx(1 / (2.0 * (5 - 3) + 1))  # hinge past b
    assert validate.max_staleness == 7


@pytest.mark.parametrize("overrides, message", [
    (["driver.kind=fedprox"], "driver.kind 'fedprox' is unknown"),
    (["driver.buffer_size=0"], "driver.buffer_size must be >= 1"),
    (["driver.concurrency=-1"], "driver.concurrency must be >= 0"),
    (["driver.staleness=exponential"], "unknown staleness function 'exponential'"),
    (["driver.staleness=polynomial", "driver.staleness_a=-1"], "exponent a must be >= 0"),
    (["driver.max_staleness=-5"], "driver.max_staleness must be >= 0"),
    (["aggregation.max_staleness=5"], "use driver.max_staleness"),
    (["driver.staleness_a=x"], "driver.staleness_a must be float"),
    (["driver.alpha=0"], "driver.alpha must be in (0, 1]"),
    (["driver.deadline_s=-1"], "driver.deadline_s must be >= 0"),
    (["driver.late_policy=wait"], "driver.late_policy 'wait' is unknown"),
    (["driver.target_accuracy=1.5"], "driver.target_accuracy must be in [0, 1]"),
    (["driver.speed=3"], "driver.speed"),
    (["clients.straggler_fraction=1.2"], "clients.straggler_fraction must be in [0, 1]"),
    (["clients.straggler_slowdown=0.5"], "clients.straggler_slowdown must be >= 1"),
    (["clients.speed_sigma=-0.1"], "clients.speed_sigma must be in [0, 5]"),
    (["clients.offline_fraction=2"], "clients.offline_fraction must be in [0, 1]"),
    (["clients.compute_s=0"], "clients.compute_s must be > 0"),
    (["aggregation.staleness=polynomial"], "the staleness keys live in [driver]"),
    (["driver.kind=fedbuff", "driver.buffer_size=50"], "exceeds federation.clients"),
    (["driver.concurrency=21"], "driver.concurrency (21) exceeds federation.clients"),
    (["driver.kind=fedasync", "aggregation.combine=median"], "needs aggregation.combine 'mean'"),
    (["driver.kind=fedbuff", "driver.late_policy=carry"], "'carry' is for the sync driver"),
    (["driver.kind=fedasync", "secagg.enabled=true"], "a single update cannot be hidden"),
    (["driver.kind=fedasync", "dp.mode=central", "dp.noise_multiplier=1.0",
      "aggregation.weight_by=uniform"], "cannot run with [dp]"),
    (["driver.kind=fedbuff", "driver.buffer_size=4", "aggregation.combine=krum",
      "aggregation.f=2"], "Krum with f=2 needs more than 6 clients per round, got 4"),
])
def test_bad_driver_or_clients_settings_fail_at_start(overrides, message):
    with pytest.raises(ValueError) as err:
        load_scenario("default", overrides)
    assert message in str(err.value)
