"""Differential privacy wired through the real ServerApp and ClientApp."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from simulations.config import load_scenario
from simulations.task import ScenarioTask

CENTRAL = ["federation.clients=5", "federation.rounds=3", "train.local_epochs=1",
           'dp.mode="central"', 'aggregation.weight_by="uniform"', "dp.clip=1.0",
           "dp.noise_multiplier=1.0", "dp.delta=1e-5"]


def zero_update_app() -> ClientApp:
    """Returns the global weights unchanged: the aggregate is then pure DP noise."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = ArrayRecord(msg.content["arrays"].to_numpy_ndarrays())
        arrays = ArrayRecord(dict(zip(msg.content["arrays"].keys(),
                                      msg.content["arrays"].values(), strict=True)))
        return Message(RecordDict({"arrays": arrays,
                                   "metrics": MetricRecord({"num-examples": 10})}),
                       reply_to=msg)

    return app


def test_central_dp_ledger_matches_dp_accounting(run_inprocess, store):
    cfg = load_scenario("default", [*CENTRAL, "federation.sample_fraction=0.4"])
    summary = run_inprocess(cfg)
    ledger = store.privacy_ledger(summary["run_id"])
    assert [e["round"] for e in ledger] == [1, 2, 3]
    # 2 of 5 clients per round, sampled without replacement, 3 rounds, noise std z C = 1:
    # replacing one client moves the clipped sum by up to 2C, so the multiplier against the
    # replace-one sensitivity is 1 / 2
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        5, 2, dp_accounting.GaussianDpEvent(1.0 * 1.0 / (2 * 1.0)))
    expected = []
    for _ in range(3):
        acc.compose(event)
        expected.append(acc.get_epsilon(1e-5))
    np.testing.assert_allclose([e["epsilon"] for e in ledger], expected, rtol=1e-9)
    assert summary["epsilon"] == pytest.approx(expected[-1])
    assert summary["protects_against"] == "released model" and "epsilon_model" not in summary
    assert {e["protects_against"] for e in ledger} == {"released model"}
    assert all(e["epsilon_model"] is None for e in ledger)
    rounds = store.rounds(summary["run_id"])
    assert rounds[-1].metrics["epsilon"] == pytest.approx(expected[-1])


def test_budget_stops_before_the_round_that_would_exceed_it(run_inprocess, store):
    probe = load_scenario("default", CENTRAL)
    summary = run_inprocess(probe)
    eps = [e["epsilon"] for e in store.privacy_ledger(summary["run_id"])]
    budget = (eps[1] + eps[2]) / 2  # round 3 would cross it
    cfg = load_scenario("default", [*CENTRAL, f"dp.epsilon_budget={budget}"])
    stopped = run_inprocess(cfg)
    assert stopped["status"] == "stopped" and stopped["rounds"] == 2
    assert "before round 3" in stopped["stop_reason"]
    assert stopped["epsilon"] <= budget
    assert store.get_run(stopped["run_id"]).status == "stopped"


def test_central_noise_scale_is_z_times_clip_over_clients(run_inprocess, store):
    z, clip, clients = 2.0, 0.5, 5
    cfg = load_scenario("default", [*CENTRAL, "federation.rounds=1", f"dp.clip={clip}",
                                    f"dp.noise_multiplier={z}"])
    summary = run_inprocess(cfg, zero_update_app())
    initial, _ = ScenarioTask.from_config(cfg).initial_params()
    noise = store.load_checkpoint(summary["run_id"]).params - initial
    # (sum of zero deltas + N(0, (zC)^2)) / clients per round; the noise is fresh OS
    # entropy, so the bounds are 6 standard errors (std: 1% for 4810 values)
    assert np.std(noise) == pytest.approx(z * clip / clients, rel=0.065)
    assert abs(np.mean(noise)) < 6 * z * clip / clients / np.sqrt(noise.size)


def test_local_dp_clients_send_noised_deltas(run_inprocess, store):
    z, clip = 1.0, 0.1
    cfg = load_scenario("default", ["federation.clients=5", "federation.rounds=1",
                                    'dp.mode="local"', f"dp.clip={clip}",
                                    f"dp.noise_multiplier={z}"])
    summary = run_inprocess(cfg)
    dim = ScenarioTask.from_config(cfg).initial_params()[1].dim
    norms = [u.norm for _, u in store.updates(summary["run_id"], round=1)]
    # clipped delta (norm <= C) plus N(0, (zC)^2) per coordinate: norm ~ zC sqrt(d)
    for norm in norms:
        assert norm == pytest.approx(z * clip * np.sqrt(dim), rel=0.1)
    assert summary["epsilon"] > 0 and summary["dp_mode"] == "local"


def test_dp_sgd_epsilon_reaches_the_store(run_inprocess, store):
    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1",
                                    "train.local_epochs=1", "train.momentum=0.0",
                                    "train.dp_sgd_noise_multiplier=1.0"])
    summary = run_inprocess(cfg)
    eps = [u.metrics["dp_sgd_epsilon"] for _, u in store.updates(summary["run_id"], round=1)]
    assert len(eps) == 3 and all(0 < e < 100 for e in eps)
