"""Differential privacy wired through the real ServerApp and ClientApp."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.protocol.keys import ConfigKey, RecordName
from server.app import make_server_app
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
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
    # the budget caps the replace-one figure (dp.budget_relation's default)
    ledger = store.privacy_ledger(summary["run_id"])
    key = "epsilon" if ledger[0]["relation"] == "replace-one" else "epsilon_replace_one"
    eps = [e[key] for e in ledger]
    budget = (eps[1] + eps[2]) / 2  # round 3 would cross it
    cfg = load_scenario("default", [*CENTRAL, f"dp.epsilon_budget={budget}"])
    stopped = run_inprocess(cfg)
    assert stopped["status"] == "stopped" and stopped["rounds"] == 2
    assert "before round 3" in stopped["stop_reason"]
    assert f"{key} (replace-one) would reach" in stopped["stop_reason"]
    assert stopped[key] <= budget < eps[2]
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
                                    "aggregation.weight_by=uniform",
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


# ---- DP-SGD composed over each client's rounds

DP_SGD = ["federation.clients=5", "train.local_epochs=1", "train.momentum=0.0",
          "train.batch_size=16", "train.dp_sgd_noise_multiplier=1.0", "train.dp_sgd_delta=1e-5"]


def _sgd_epsilon(n: int, rounds: int, *, batch: int = 16, epochs: int = 1, z: float = 1.0,
                 delta: float = 1e-5) -> float:
    """dp_accounting's epsilon of ``rounds`` rounds of local DP-SGD on ``n`` examples: each
    step samples every example with probability q = batch / n (add/remove one example moves
    the sum of clipped per-sample gradients by the clip C, whose noise is z C), one
    epoch is the n / batch expected batches."""
    q = min(1.0, batch / n)
    steps = rounds * epochs * max(1, round(n / batch))
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def _participations(store, run_id: str) -> dict[str, list[tuple[int, dict]]]:
    """Each client's (round, metrics) of the rounds it trained, in round order."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for rnd, u in store.updates(run_id):
        if "dp_sgd_epsilon" in u.metrics:
            out.setdefault(u.client_id, []).append((rnd, u.metrics))
    return out


def test_dp_sgd_epsilon_composes_each_clients_rounds(run_inprocess, store):
    cfg = load_scenario("default", [*DP_SGD, "federation.rounds=4",
                                    "federation.sample_fraction=0.4"])
    summary = run_inprocess(cfg)
    run_id = summary["run_id"]
    trained = _participations(store, run_id)
    sizes = {u.client_id: u.num_examples for _, u in store.updates(run_id)}
    counts = sorted(len(v) for v in trained.values())
    assert len(counts) >= 2 and counts[0] < counts[-1]  # sampled: clients differ in rounds
    largest = 0.0
    for client, rounds in trained.items():
        for k, (_, metrics) in enumerate(rounds, start=1):  # its k-th round composes k
            assert metrics["dp_sgd_rounds"] == k
            assert metrics["dp_sgd_epsilon"] == pytest.approx(
                _sgd_epsilon(sizes[client], k), rel=1e-9)
            assert metrics["dp_sgd_epsilon_next"] == pytest.approx(
                _sgd_epsilon(sizes[client], k + 1), rel=1e-9)
        largest = max(largest, rounds[-1][1]["dp_sgd_epsilon"])
    for info in store.rounds(run_id)[1:]:  # the round metric: the largest of the round
        in_round = [m["dp_sgd_epsilon"] for rounds in trained.values()
                    for rnd, m in rounds if rnd == info.round]
        assert info.metrics["dp_sgd_epsilon"] == pytest.approx(max(in_round))
    assert summary["dp_sgd_epsilon"] == pytest.approx(largest)
    assert store.get_run(run_id).summary["dp_sgd_epsilon"] == pytest.approx(largest)
    assert summary["dp_sgd_protects"] == \
        "individual training examples of one client (sample-level)"
    assert summary["dp_sgd_protects_against"] == \
        "the server and anyone who sees that client's updates"


def test_dp_sgd_budget_stops_the_run_before_a_client_would_pass_it(run_inprocess, store):
    probe = run_inprocess(load_scenario("default", [*DP_SGD, "federation.rounds=1"]))
    sizes = [u.num_examples for _, u in store.updates(probe["run_id"])]
    # every client trains every round: round r composes r rounds for each of them
    worst = [max(_sgd_epsilon(n, r) for n in sizes) for r in (1, 2, 3, 4)]
    budget = (worst[1] + worst[2]) / 2  # a third round would take a client past it
    cfg = load_scenario("default", [*DP_SGD, "federation.rounds=5",
                                    f"train.dp_sgd_epsilon_budget={budget}"])
    summary = run_inprocess(cfg)
    assert summary["status"] == "stopped" and summary["rounds"] == 2
    assert "before round 3" in summary["stop_reason"]
    assert "train.dp_sgd_epsilon_budget" in summary["stop_reason"]
    assert summary["dp_sgd_epsilon"] == pytest.approx(worst[1]) and worst[1] <= budget
    assert summary["dp_sgd_epsilon_budget"] == budget


def test_a_client_past_its_dp_sgd_budget_refuses_with_a_stored_reason(run_inprocess, store):
    probe = run_inprocess(load_scenario("default", [*DP_SGD, "federation.rounds=1"]))
    sizes = {u.client_id: u.num_examples for _, u in store.updates(probe["run_id"])}
    first = {c: _sgd_epsilon(n, 1) for c, n in sizes.items()}
    ordered = sorted(set(first.values()))
    budget = (ordered[-1] + ordered[-2]) / 2  # the smallest partitions' first round passes it
    cfg = load_scenario("default", [*DP_SGD, "federation.rounds=1",
                                    f"train.dp_sgd_epsilon_budget={budget}"])
    summary = run_inprocess(cfg)
    fates = {u.client_id: u for _, u in store.updates(summary["run_id"], round=1)}
    refused = {c for c, e in first.items() if e > budget}
    assert refused and {c for c, u in fates.items() if u.fate == "rejected"} == refused
    for client in refused:
        assert "train.dp_sgd_epsilon_budget" in fates[client].reason
        assert "dp_sgd_epsilon" not in fates[client].metrics
    assert all(u.metrics["dp_sgd_epsilon"] <= budget for c, u in fates.items()
               if c not in refused)


class _ServerKilled(BaseException):
    """Ends the server process's run mid-round, as a kill would."""


def _killed_at(round_: int):
    def app(msg: Message, context: Context) -> Message:
        if msg.content[RecordName.CONFIG][ConfigKey.SERVER_ROUND] >= round_:
            raise _ServerKilled
        return client_app(msg, context)
    return app


def test_a_resumed_run_never_under_reports_dp_sgd_epsilon(db_url, store):
    """A resume restarts the in-process clients with empty node state: each must still
    report at least the composition of every round it trained, before the resume too."""
    cfg = load_scenario("default", [*DP_SGD, "federation.rounds=4",
                                    "federation.sample_fraction=0.6"])

    def serve(app, resume: str | None = None) -> dict:
        result: dict = {}
        make_server_app(build_task, config_from_run_config, config=cfg, store_url=db_url,
                        on_summary=result.update, resume=resume)(
            InProcessGrid(app, 5), Context(run_id=1, node_id=0, node_config={},
                                           state=RecordDict(), run_config={}))
        return result

    with pytest.raises(_ServerKilled):
        serve(_killed_at(3))
    run_id = store.list_runs()[0].run_id
    summary = serve(client_app, resume=run_id)
    assert summary["rounds"] == 4 and summary.get("resumed_after_round") == 2
    trained = _participations(store, run_id)
    sizes = {u.client_id: u.num_examples for _, u in store.updates(run_id)}
    across = 0
    for client, rounds in trained.items():
        for k, (_, metrics) in enumerate(rounds, start=1):  # k: the rounds it really trained
            assert metrics["dp_sgd_epsilon"] >= _sgd_epsilon(sizes[client], k) * (1 - 1e-9)
            assert metrics["dp_sgd_rounds"] >= k
        across += rounds[0][0] <= 2 < rounds[-1][0]
    assert across  # a client trained before and after the resume
    largest = max(_sgd_epsilon(sizes[c], len(r)) for c, r in trained.items())
    assert summary["dp_sgd_epsilon"] >= largest * (1 - 1e-9)


def test_fedring_simulate_json_has_the_largest_dp_sgd_epsilon(tmp_path):
    db = f"sqlite:///{tmp_path / 'store.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "simulations.cli", "simulate", "--clients", "4", "--rounds", "2",
         "--db", db, "--json", "--set", "federation.sample_fraction=0.5",
         *(arg for s in DP_SGD[1:] for arg in ("--set", s))],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with Store(db) as store:
        reported = [u.metrics["dp_sgd_epsilon"] for _, u in store.updates(summary["run_id"])]
    assert len(reported) == 4  # 2 of 4 clients in each of 2 rounds
    assert summary["dp_sgd_epsilon"] == pytest.approx(max(reported))
    printed = " ".join(proc.stderr.split())  # the final line, as the console wrapped it
    assert (f"dp_sgd_epsilon {summary['dp_sgd_epsilon']:.3f} (add/remove-one training "
            "example, the largest over clients) protecting individual training examples of "
            "one client (sample-level) against the server and anyone who sees that client's "
            "updates") in printed


@pytest.mark.slow
def test_dp_sgd_composes_on_flowers_simulation_engine(db_url, store):
    """Flower's Ray engine keeps each node's state across rounds as the in-process one
    does: every client's k-th round reports k rounds composed."""
    from simulations.cli import run_simulation

    cfg = load_scenario("default", [*DP_SGD, "federation.clients=3", "federation.rounds=3"])
    summary = run_simulation(cfg, engine="flower", db=db_url)
    trained = _participations(store, summary["run_id"])
    sizes = {u.client_id: u.num_examples for _, u in store.updates(summary["run_id"])}
    assert len(trained) == 3
    for client, rounds in trained.items():
        assert [rnd for rnd, _ in rounds] == [1, 2, 3]
        for k, (_, metrics) in enumerate(rounds, start=1):
            assert metrics["dp_sgd_rounds"] == k
            assert metrics["dp_sgd_epsilon"] == pytest.approx(
                _sgd_epsilon(sizes[client], k), rel=1e-9)
    assert summary["dp_sgd_epsilon"] == pytest.approx(
        max(_sgd_epsilon(n, 3) for n in sizes.values()), rel=1e-9)
