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
    assert s.graph(100) == (34, 18)  # default_k at 10% dropouts, 5% corrupt clients
    assert SecAggScenarioConfig(corrupt_fraction=0.1).graph(100) == (56, 29)
    assert SecAggScenarioConfig(corrupt_fraction=0.01).graph(100) == (31, 16)
    assert s.graph(3) == (2, 2)  # three clients: the full graph, all three needed
    for n, least in ((2, 3), (4, 5)):  # e.g. a Poisson cohort or the nodes left online
        with pytest.raises(ValueError, match=f"at least secagg.min_survivors = {least} "
                                             f"participants per round, got {n}"):
            SecAggScenarioConfig(min_survivors=least).graph(n)
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
    (["secagg.neighbors=0"], "secagg.neighbors = 0 is below the minimum 3"),
    (["secagg.threshold=1.5"], "secagg.threshold must be"),
    (['secagg.dropout_stage="later"'], "secagg.dropout_stage must be"),
    (["federation.clients=1", "federation.min_clients=1"],
     "at least secagg.min_survivors = 3 clients"),
])
def test_other_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_scenario("default", [*ON, *overrides])


# explicit settings below the secure-aggregation policy: each names its key and minimum
WEAK = [
    (["secagg.neighbors=1"], r"secagg.neighbors = 1 is below the minimum 3.*set "
                             r"secagg.neighbors >= 3, 'auto' or 'full'"),
    (["secagg.neighbors=2"], r"secagg.neighbors = 2 is below the minimum 3"),
    (["secagg.threshold=1"], r"secagg.threshold = 1 is below the minimum 2 .*set "
                             r"secagg.threshold >= 2 or a fraction >= 0.5"),
    (["secagg.threshold=0.4"], r"secagg.threshold = 0.4 is below the minimum fraction 0.5"),
    (["secagg.threshold=0.49"], r"secagg.threshold = 0.49 is below the minimum fraction 0.5"),
    (['secagg.neighbors="full"', "secagg.threshold=9"],
     r"secagg.threshold = 9 is not more than half of the 19 neighbours .* at least 10"),
    (["secagg.neighbors=6", "secagg.threshold=3"],
     r"secagg.threshold = 3 is not more than half of the 6 neighbours"),
    (["secagg.min_survivors=2"], r"secagg.min_survivors = 2 is below the minimum 3.*set "
                                 r"secagg.min_survivors to an integer >= 3"),
    (["secagg.corrupt_fraction=0.0"], r"secagg.corrupt_fraction must be in \(0, 1\)"),
    (["federation.clients=2", "federation.min_clients=2"],
     r"at least secagg.min_survivors = 3 clients per round, the federation samples 2"),
    (["federation.clients=10", "secagg.min_survivors=11"],
     r"at least secagg.min_survivors = 11 clients per round, the federation samples 10"),
    (['driver.kind="fedbuff"', "driver.buffer_size=2"],
     r"needs at least secagg.min_survivors = 3 updates: raise driver.buffer_size"),
]


@pytest.mark.parametrize(("overrides", "message"), WEAK, ids=[" ".join(w[0]) for w in WEAK])
def test_weak_settings_fail_at_start_naming_the_key_and_minimum(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_scenario("default", [*ON, "federation.clients=20", *overrides])


def test_settings_at_the_policy_minimums_are_accepted():
    for overrides in (["secagg.neighbors=3"], ["secagg.threshold=2", "secagg.neighbors=3"],
                      ["secagg.threshold=0.5"], ["secagg.min_survivors=3"],
                      ['secagg.neighbors="full"', "secagg.threshold=11"]):
        load_scenario("default", [*ON, "federation.clients=20", *overrides])
    assert SecAggScenarioConfig(min_survivors=4).policy.min_survivors == 4


def test_the_server_app_refuses_a_hand_made_config_before_any_round(run_inprocess, store):
    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1"])
    cfg["secagg"] = {**cfg["secagg"], "enabled": True}
    cfg["aggregation"] = {**cfg["aggregation"], "combine": "median"}
    with pytest.raises(ValueError, match="only ever sees the weighted sum"):
        run_inprocess(cfg)
    assert store.list_runs() == []
