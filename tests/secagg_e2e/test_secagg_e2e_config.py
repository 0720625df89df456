"""The ``[secagg]`` section: defaults, and what is refused at start (with why)."""

from __future__ import annotations

import pytest

from server.secagg_config import SecAggScenarioConfig, exposure_warning
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


# an explicit k (or t) short of Bell et al.'s bound for corrupt_fraction: a loud warning


def _exposed(n: int, k: int, t: int, gamma: float = 0.05) -> tuple[float, float]:
    """(fraction of a round's clients with >= t of k neighbours corrupt, n times it), from
    scipy: each neighbour is corrupt with probability gamma, independently."""
    from scipy.stats import binom

    p = float(binom.sf(t - 1, k, gamma))
    return p, n * p


def test_an_explicit_k_short_of_the_bound_warns_with_the_exposed_share():
    cfg = load_scenario("default", [*ON, "secagg.neighbors=3"])  # 20 clients, all each round
    p, some = _exposed(20, 3, 2)
    assert round(100 * p, 3) == 0.725  # the tracker's "about 0.7% of clients a round"
    text = exposure_warning(cfg)
    assert text.startswith("WARNING: secagg.neighbors = 3 gives k = 3, t = 2 at 20 clients")
    assert f"{100 * p:.3g}% of a round's clients" in text and f"up to {some:.3g} " in text
    assert "secagg.corrupt_fraction = 0.05" in text and "2^-40" in text
    assert 'raise secagg.neighbors, or set secagg.neighbors = "auto" (k = 19, t = 10' in text


def test_an_explicit_threshold_enters_the_same_figure_and_is_named():
    cfg = load_scenario("default", [*ON, "secagg.neighbors=3", "secagg.threshold=3"])
    p, _ = _exposed(20, 3, 3)
    text = exposure_warning(cfg)
    assert "secagg.threshold = 3 give k = 3, t = 3" in text
    assert f"{100 * p:.3g}% of a round's clients" in text
    assert "raise secagg.neighbors or secagg.threshold" in text
    assert p < _exposed(20, 3, 2)[0]  # a higher t exposes fewer


def test_the_warning_uses_the_expected_cohort_and_the_buffer():
    poisson = load_scenario("default", [*ON, "secagg.neighbors=3", "federation.clients=100",
                                        "federation.sample_fraction=0.2",
                                        'federation.sampling="poisson"'])
    assert "at 20 clients a round" in exposure_warning(poisson)
    buffered = load_scenario("default", [*ON, "secagg.neighbors=3", 'driver.kind="fedbuff"',
                                         "driver.buffer_size=9"])
    assert "k = 4, t = 3 at 9 clients a round" in exposure_warning(buffered)  # 9 * 3 is odd


def test_no_warning_for_auto_full_or_a_k_that_meets_the_bound():
    # the least k whose t = floor(k/2) + 1 meets n * P[Bin(k, 0.05) >= t] <= 2^-40 at n = 100
    least = next(k for k in range(3, 99) if _exposed(100, k, k // 2 + 1)[1] <= 2.0**-40)
    assert least == 34
    hundred = [*ON, "federation.clients=100"]
    assert exposure_warning(load_scenario("default", [*hundred, f"secagg.neighbors={least}"])) \
        is None
    assert "k = 33, t = 17 at 100 clients" in exposure_warning(
        load_scenario("default", [*hundred, f"secagg.neighbors={least - 1}"]))
    for overrides in ([], ['secagg.neighbors="full"'], ["secagg.neighbors=19"],
                      ["secagg.threshold=0.7"], ["federation.clients=100"]):
        # at 20 clients even the full graph misses 2^-40 (n * P = 1.2e-7): "auto" picks it
        # and is not warned about, nor is an explicit k as good as it
        assert exposure_warning(load_scenario("default", [*ON, *overrides])) is None, overrides
    assert _exposed(20, 19, 10)[1] > 2.0**-40
    assert exposure_warning(load_scenario("default", ["secagg.neighbors=3"])) is None  # off


def test_the_cli_run_shows_the_warning_once_not_per_round(run_inprocess, capsys):
    cfg = load_scenario("default", [*ON, "secagg.neighbors=3", "federation.clients=8",
                                    "federation.rounds=2", "train.local_epochs=1"])
    summary = run_inprocess(cfg)
    assert summary["status"] == "completed" and summary["versions"] == 2
    out = capsys.readouterr().out
    assert out.count("WARNING: secagg.neighbors = 3 gives k = 3, t = 2 at 8 clients") == 1
    assert "round 1/2" in out and "round 2/2" in out
