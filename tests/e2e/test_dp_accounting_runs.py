"""Whole runs: the accounted epsilon and the sampling that happened, against dp_accounting.

The multipliers and relations are derived here: fixed-size cohorts are replace-one (the
clipped sum moves by 2C, so the multiplier is z / 2), the server's view of local and
distributed DP is an unsampled Gaussian per round under zero-out (a client's contribution
moves between its value and zero: multiplier z), and its replace-one figure the Gaussian
at z / 2.
"""

from __future__ import annotations

import re

import dp_accounting as dpa
import pytest

from simulations.config import load_scenario
from simulations.report import plot_run, privacy_summary

REPLACE_ONE = dpa.NeighboringRelation.REPLACE_ONE
DELTA = 1e-5


def fixed(rounds: int, population: int, cohort: int, z: float) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(population, cohort,
                                                     dpa.GaussianDpEvent(z / 2)), rounds)
    return acc.get_epsilon(DELTA)


def unamplified(rounds: int, z: float) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(z), rounds)
    return acc.get_epsilon(DELTA)


CENTRAL = ["dp.mode=central", "dp.clip=1.0", "dp.noise_multiplier=1.1", "dp.delta=1e-5",
           "federation.sample_fraction=0.25", "aggregation.weight_by=uniform",
           "train.local_epochs=1"]


def test_central_acceptance_figure(run_inprocess, store):
    """finding 1: 10 rounds, 5 of 20 clients, z = 1.1 -> 24.96 (was 8.66)."""
    summary = run_inprocess(load_scenario("default", [*CENTRAL, "federation.rounds=10"]))
    assert summary["status"] == "completed" and summary["rounds"] == 10
    assert summary["epsilon"] == pytest.approx(24.96, rel=0.01)
    assert summary["epsilon"] == pytest.approx(fixed(10, 20, 5, 1.1), rel=1e-9)
    assert summary["protects_against"] == "released model"
    assert "epsilon_model" not in summary


def test_distributed_acceptance_figures(run_inprocess, store, tmp_path):
    """finding 2: 5 rounds, 10 of 20, z = 1: the server's epsilon 12.30 (no amplification,
    add/remove), the released model's amplified."""
    cfg = load_scenario("default", [
        "secagg.enabled=true", "dp.mode=distributed", "dp.clip=1.0", "dp.noise_multiplier=1.0",
        "dp.delta=1e-5", "federation.sample_fraction=0.5", "aggregation.weight_by=uniform",
        "federation.rounds=5", "train.local_epochs=1"])
    summary = run_inprocess(cfg)
    assert summary["status"] == "completed" and summary["versions"] == 5
    ledger = store.privacy_ledger(summary["run_id"])
    z = ledger[0]["noise_multiplier"]  # the plan's effective multiplier
    assert z == pytest.approx(1.0, rel=1e-3)
    assert summary["epsilon"] == pytest.approx(12.30, rel=0.03)
    assert summary["epsilon"] == pytest.approx(unamplified(5, z), rel=1e-9)
    assert summary["epsilon_model"] == pytest.approx(fixed(5, 20, 10, z), rel=1e-9)
    assert summary["protects_against"] == "server"
    assert [e["protects_against"] for e in ledger] == ["server"] * 5
    assert [e["epsilon"] for e in ledger] == pytest.approx(
        [unamplified(r, z) for r in range(1, 6)], rel=1e-9)
    assert [e["epsilon_model"] for e in ledger] == pytest.approx(
        [fixed(r, 20, 10, z) for r in range(1, 6)], rel=1e-9)
    assert [e["epsilon_replace_one"] for e in ledger] == pytest.approx(
        [unamplified(r, z / 2) for r in range(1, 6)], rel=1e-9)
    assert {(e["relation"], e["relation_model"]) for e in ledger} == {
        ("zero-out", "replace-one")}
    line = privacy_summary(ledger)
    assert "epsilon 12.3 (zero-out), epsilon_replace_one 30.13 (replace-one) against the " \
           "server" in line
    assert "epsilon_model 26.84 (replace-one) against the released model" in line
    assert plot_run(store, summary["run_id"], tmp_path).exists()


def cohorts(store, run_id: str, rounds: int) -> list[set[str]]:
    return [{u.client_id for _, u in store.updates(run_id, round=r)}
            for r in range(1, rounds + 1)]


def test_dp_cohorts_are_secret_unless_reproducible_is_asked_for(run_inprocess, store):
    base = ["federation.rounds=3", "train.local_epochs=1", "dp.mode=central", "dp.clip=1.0",
            "aggregation.weight_by=uniform", "federation.sample_fraction=0.25"]
    secret = [cohorts(store, run_inprocess(load_scenario("default", base))["run_id"], 3)
              for _ in range(2)]
    assert all(len(c) == 5 for c in secret[0] + secret[1])
    assert secret[0] != secret[1]  # the same seed, other cohorts (C(20,5)^3 draws)
    replay = ["dp.reproducible_cohorts=true", *base]
    runs = [run_inprocess(load_scenario("default", replay)) for _ in range(2)]
    assert cohorts(store, runs[0]["run_id"], 3) == cohorts(store, runs[1]["run_id"], 3)
    # seeded cohorts: no amplification, add/remove with z = 1, replace-one with z / 2
    assert runs[0]["epsilon"] == pytest.approx(unamplified(3, 1.0), rel=1e-9)
    assert runs[0]["relation"] == "add/remove-one"
    assert runs[0]["epsilon_replace_one"] == pytest.approx(unamplified(3, 0.5), rel=1e-9)


def test_a_concurrency_cap_is_charged_the_cohort_it_leaves(run_inprocess, store):
    cfg = load_scenario("default", ["federation.clients=10", "federation.rounds=2",
                                    "train.local_epochs=1", "dp.mode=central", "dp.clip=1.0",
                                    "aggregation.weight_by=uniform",
                                    "federation.sample_fraction=0.5", "driver.concurrency=3"])
    summary = run_inprocess(cfg)
    assert [len(c) for c in cohorts(store, summary["run_id"], 2)] == [3, 3]
    assert summary["epsilon"] == pytest.approx(fixed(2, 10, 3, 1.0), rel=1e-9)


@pytest.mark.parametrize("overrides, key", [
    (["driver.late_policy=carry"], "driver.late_policy"),
    (["clients.offline_fraction=0.2"], "clients.offline_fraction"),
    (["federation.sampling=poisson", "federation.sample_fraction=0.5",
      "driver.concurrency=5"], "driver.concurrency"),
])
def test_sampling_the_accountant_cannot_model_fails_at_start(overrides, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        load_scenario("default", ["dp.mode=central", "aggregation.weight_by=uniform",
                                  *overrides])
    load_scenario("default", overrides)  # fine without DP


def test_a_client_left_out_by_an_earlier_cohort_stops_a_dp_run(run_inprocess):
    cfg = load_scenario("default", [
        "federation.clients=4", "federation.rounds=3", "train.local_epochs=1",
        "dp.mode=central", "dp.clip=1.0", "aggregation.weight_by=uniform",
        "clients.straggler_fraction=0.5", "clients.straggler_slowdown=10",
        "driver.deadline_s=2.0"])
    with pytest.raises(RuntimeError, match=r"round 2: only 2 of 4 .*driver\.deadline_s"):
        run_inprocess(cfg, simulated=True)


def test_local_dp_with_example_weights_fails_at_start_naming_the_key():
    """The model's weights would come from example counts sent in the clear."""
    with pytest.raises(ValueError, match=r"local DP .*aggregation\.weight_by = 'uniform'"):
        load_scenario("default", ["dp.mode=local", "aggregation.weight_by=examples"])
    load_scenario("default", ["dp.mode=local", "aggregation.weight_by=uniform"])


def test_a_budget_relation_without_a_figure_fails_at_start_naming_the_key():
    with pytest.raises(ValueError, match=r"dp\.budget_relation = 'add/remove-one'.*has: "
                                         r"replace-one"):
        load_scenario("default", ["dp.mode=central", "aggregation.weight_by=uniform",
                                  "federation.sample_fraction=0.5", "dp.epsilon_budget=10",
                                  "dp.budget_relation=add/remove-one"])
