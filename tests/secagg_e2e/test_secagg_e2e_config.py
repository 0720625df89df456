"""The ``[secagg]`` section: defaults, and what is refused at start (with why)."""

from __future__ import annotations

import pytest

from server.secagg_config import SecAggScenarioConfig
from simulations.config import load_scenario

ON = ["secagg.enabled=true"]


def test_defaults_and_graph_choices():
    cfg = load_scenario("default", ON)["secagg"]
    assert cfg["neighbors"] == "auto" and cfg["threshold"] == 0.5 and cfg["bits"] == 32
    s = SecAggScenarioConfig(enabled=True)
    assert s.graph(100) == (31, 16)  # privacy.secagg.default_k at 10% dropouts
    assert s.graph(10) == (9, 5)  # no sparser graph meets the bounds: full SecAgg
    assert SecAggScenarioConfig(neighbors="full").graph(50) == (49, 25)
    assert SecAggScenarioConfig(neighbors=3).graph(100) == (3, 2)
    assert SecAggScenarioConfig(neighbors=3).graph(9) == (4, 3)  # 9 * 3 is odd
    assert SecAggScenarioConfig(neighbors=3, threshold=3).graph(100) == (3, 3)
    assert SecAggScenarioConfig(neighbors=40).graph(5) == (4, 3)


@pytest.mark.parametrize("combine", ["median", "krum", "trimmed_mean"])
def test_a_non_linear_combine_is_refused_because_the_server_sees_only_the_sum(combine):
    with pytest.raises(ValueError, match="only ever sees the weighted sum") as err:
        load_scenario("default", [*ON, f'aggregation.combine="{combine}"', "aggregation.f=1"])
    assert combine in str(err.value)


def test_a_scale_that_could_wrap_is_refused_with_the_headroom_message():
    with pytest.raises(ValueError, match=r"could wrap around 2\^32.*raise bits to >= 3[3-9]"
                                         r".*or lower clip_range to <= "):
        load_scenario("default", [*ON, "secagg.scale=1000.0", "secagg.clip_range=200.0"])


def test_too_few_bits_for_the_clients_is_refused():
    with pytest.raises(ValueError, match=r"secagg.bits = 12 leaves .* raise secagg.bits to"):
        load_scenario("default", [*ON, "secagg.bits=12", "secagg.clip_range=1.0"])


@pytest.mark.parametrize(("overrides", "message"), [
    (['dp.mode="local"', 'aggregation.weight_by="uniform"'], "dp.mode = 'local'"),
    (["aggregation.max_norm=5.0"], "cannot see an update to check its norm"),
    (['secagg.neighbors="full"', "secagg.threshold=30"], "exceeds the 19 neighbours"),
    (["secagg.neighbors=0"], "secagg.neighbors must be"),
    (["secagg.threshold=1.5"], "secagg.threshold must be"),
    (['secagg.dropout_stage="later"'], "secagg.dropout_stage must be"),
    (["federation.clients=1", "federation.min_clients=1"], "at least 2 clients"),
])
def test_other_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_scenario("default", [*ON, *overrides])


def test_the_server_app_refuses_a_hand_made_config_before_any_round(run_inprocess, store):
    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1"])
    cfg["secagg"] = {**cfg["secagg"], "enabled": True}
    cfg["aggregation"] = {**cfg["aggregation"], "combine": "median"}
    with pytest.raises(ValueError, match="only ever sees the weighted sum"):
        run_inprocess(cfg)
    assert store.list_runs() == []
