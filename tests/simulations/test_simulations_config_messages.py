"""Overrides and the messages a user sees for a bad scenario key."""

from __future__ import annotations

import pytest

from simulations.config import load_scenario
from simulations.task import ScenarioTask


@pytest.mark.parametrize("kind", ["logreg", "cnn"])
def test_switching_the_model_kind_drops_the_other_kinds_parameters(kind):
    config = load_scenario("default", [f"model.kind={kind}"])
    assert config["model"] == {"kind": kind}  # the default scenario's `hidden` is gone
    ScenarioTask.from_config(config).build_model()


def test_parameters_given_with_the_new_kind_are_kept():
    config = load_scenario("default", ["model.kind=cnn", "model.channels=[4]"])
    assert config["model"] == {"kind": "cnn", "channels": [4]}


def test_the_same_kind_keeps_the_scenario_parameters():
    assert load_scenario("default", ["model.kind=mlp"])["model"] == {"kind": "mlp",
                                                                     "hidden": [64]}
    assert load_scenario("default", ["model.hidden=[8]"])["model"]["hidden"] == [8]


def test_a_boolean_key_says_true_or_false():
    with pytest.raises(ValueError, match=r"secagg\.enabled must be true or false, got str 'yes'"):
        load_scenario("default", ["secagg.enabled=yes"])


def test_natural_partition_names_real_keys():
    with pytest.raises(ValueError,
                       match=r"set federation\.clients = 30 .*data\.options\.num_users"):
        ScenarioTask.from_config(load_scenario(
            "default", ["data.dataset=synthetic", "data.partitioner=natural",
                        "data.options={num_users = 30}"])).check()
