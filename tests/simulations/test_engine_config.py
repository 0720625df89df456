"""``[engine]``: client resources and the Ray address reach Flower's backend config."""

from __future__ import annotations

import pytest

from simulations.config import load_scenario
from simulations.engine_config import EngineConfig


def test_defaults_are_one_cpu_no_gpu_and_a_ray_of_its_own():
    config = load_scenario("default")
    assert config["engine"] == {"client_cpus": 1.0, "client_gpus": 0.0, "ray_address": "",
                                "vectorize": False, "node_cache": 10_000, "threads": "auto"}
    assert EngineConfig(**config["engine"]).backend_config() == {
        "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0}, "init_args": {}}


def test_resources_and_address_go_to_client_resources_and_ray_init():
    config = load_scenario("default", ["engine.client_cpus=2", "engine.client_gpus=0.25",
                                       "engine.ray_address=10.0.0.7:6379"])
    backend = EngineConfig(**config["engine"]).backend_config()
    assert backend["client_resources"] == {"num_cpus": 2.0, "num_gpus": 0.25}
    assert backend["init_args"] == {"address": "10.0.0.7:6379"}


@pytest.mark.parametrize("address", ["auto", "ray://head:10001", "head.example.org:6379"])
def test_ray_addresses_that_ray_init_accepts(address):
    assert EngineConfig(ray_address=address).backend_config()["init_args"]["address"] == address


@pytest.mark.parametrize(("override", "named"), [
    ("engine.client_cpus=0", "engine.client_cpus"),
    ("engine.client_gpus=-1", "engine.client_gpus"),
    ("engine.ray_address=head", "engine.ray_address"),
    ("engine.gpus=1", "engine.gpus"),
])
def test_bad_values_fail_naming_the_key(override, named):
    with pytest.raises(ValueError, match=named):
        load_scenario("default", [override])
