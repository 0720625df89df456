"""A user's task module end to end: the same runs as the built-in scenarios, its own loops,
and a stock Flower ClientApp training under fedring's ServerApp on the module's model."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch.nn import functional as F
from torch.utils.data import DataLoader

from simulations.apps import build_task, client_app, spec_from_run_config
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.module_task import make_task
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from tests.simulations.fixtures import my_task

FIXTURES = Path(__file__).resolve().parents[1] / "simulations" / "fixtures"
MY_TASK, LOOPS = FIXTURES / "my_task.py", FIXTURES / "my_task_loops.py"
BASE = ["federation.clients=4", "federation.rounds=3", "train.local_epochs=1",
        "train.lr=0.1", "train.momentum=0.0"]


def module_config(*extra: str, module: Path | str = MY_TASK) -> dict:
    return load_scenario("default", [*BASE, f"task.module={module}", *extra])


def accuracies(store, run_id: str) -> list[float]:
    return [r.metrics["accuracy"] for r in store.rounds(run_id)]


def test_fedavg_trains_the_modules_model_from_its_seeded_initial_model(run_inprocess, store):
    cfg = module_config()
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, models=models)
    assert summary["status"] == "completed" and summary["versions"] == 3
    initial, layout = build_task(cfg).initial_params()
    np.testing.assert_array_equal(models[0], initial)  # the server's model is the module's
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    acc = accuracies(store, summary["run_id"])
    assert acc[0] < 0.5 < 0.9 < acc[-1], acc
    updates = store.updates(summary["run_id"], round=1)
    assert [u.fate for _, u in updates] == ["accepted"] * 4
    assert sorted(u.num_examples for _, u in updates) == [200] * 4


def test_secure_aggregation_over_a_module_task(run_inprocess, store):
    summary = run_inprocess(module_config("secagg.enabled=true"))
    assert summary["status"] == "completed" and summary["versions"] == 3
    secure = store.secagg_rounds(summary["run_id"])
    assert len(secure) == 3 and all(r["status"] == "completed" for r in secure)
    assert accuracies(store, summary["run_id"])[-1] > 0.9


def test_central_dp_over_a_module_task(run_inprocess, store):
    summary = run_inprocess(module_config("dp.mode=central", "dp.clip=1.0",
                                          "dp.noise_multiplier=0.5",
                                          "aggregation.weight_by=uniform"))
    assert summary["status"] == "completed" and summary["versions"] == 3
    assert summary["protects_against"] == "released model" and summary["epsilon"] > 0
    ledger = store.privacy_ledger(summary["run_id"])
    assert [e["round"] for e in ledger] == [1, 2, 3]
    assert all(e["noise_multiplier"] == 0.5 for e in ledger)


def test_fedbuff_over_a_module_task(run_inprocess, store):
    summary = run_inprocess(module_config("driver.kind=fedbuff", "driver.buffer_size=2",
                                          "federation.rounds=4"), simulated=True)
    assert summary["driver"] == "fedbuff" and summary["versions"] == 4
    for r in store.rounds(summary["run_id"])[1:]:
        assert r.num_accepted == 2
    assert accuracies(store, summary["run_id"])[-1] > 0.9


def test_local_dp_compression_and_a_robust_combine_over_a_module_task(run_inprocess, store):
    summary = run_inprocess(module_config("dp.mode=local", "dp.clip=5.0",
                                          "aggregation.weight_by=uniform",
                                          "dp.noise_multiplier=0.01", "compression.kind=qsgd",
                                          "aggregation.combine=median"))
    assert summary["status"] == "completed" and summary["versions"] == 3
    assert summary["protects_against"] == "server"
    assert accuracies(store, summary["run_id"])[-1] > 0.9


def test_the_modules_own_train_and_evaluate_are_called(run_inprocess, store):
    summary = run_inprocess(module_config("train.batch_size=50", module=LOOPS))
    assert summary["status"] == "completed"
    rounds = store.rounds(summary["run_id"])
    assert all(r.metrics["own_eval"] == 1.0 for r in rounds)  # central: the module's
    updates = [u for _, u in store.updates(summary["run_id"], round=1)]
    assert [u.metrics["own_train_steps"] for u in updates] == [4.0] * 4  # 200 / 50, 1 epoch
    assert all("train_loss" in u.metrics for u in updates)
    assert rounds[-1].metrics["accuracy"] > 0.9


def test_fedrings_client_app_under_flower_fedavg_uses_the_modules_loops():
    """A stock strategy sends no task: the client resolves it from the run config."""
    model = my_task.build_model()
    run_config = {"scenario": "default",
                  "overrides": f"task.module={LOOPS} federation.clients=4 train.batch_size=50 "
                               "train.local_epochs=1 task.client_test_fraction=0.25"}
    grid = InProcessGrid(client_app, 4, run_config=run_config)
    result = FedAvg(fraction_evaluate=1.0).start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=2,
        train_config=ConfigRecord({}))
    assert result.train_metrics_clientapp[1]["own_train_steps"] == 3.0  # 150 of 200 / 50
    evaluated = result.evaluate_metrics_clientapp[2]
    assert evaluated["eval_own_eval"] == 1.0  # the module's evaluate, on each client
    assert 0 <= evaluated["eval_acc"] <= 1 and evaluated["eval_loss"] > 0


def test_a_module_import_name_runs_too(run_inprocess, store):
    summary = run_inprocess(module_config("federation.rounds=1",
                                          module="tests.simulations.fixtures.my_task"))
    assert summary["status"] == "completed" and summary["versions"] == 1


@pytest.mark.slow
def test_flower_engine_runs_a_module_task_like_the_inprocess_engine(db_url, store):
    cfg = module_config("federation.rounds=2")
    a = run_simulation(cfg, engine="inprocess", db=db_url)
    b = run_simulation(cfg, engine="flower", db=db_url)
    assert a["versions"] == b["versions"] == 2
    pa = store.load_checkpoint(a["run_id"]).params
    pb = store.load_checkpoint(b["run_id"]).params
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_cross_silo_rings_over_a_module_task(run_inprocess, store):
    grid = ConcurrentGrid(silo_client_app(make_task, spec_from_run_config), 3)
    summary = run_inprocess(module_config("federation.clients=3", "driver.kind=cross_silo"),
                            grid=grid)
    assert summary["driver"] == "cross_silo" and summary["versions"] == 3
    assert accuracies(store, summary["run_id"])[-1] > 0.9


def test_a_silo_refuses_a_module_train_it_cannot_run(run_inprocess, store):
    grid = ConcurrentGrid(silo_client_app(make_task, spec_from_run_config), 3)
    summary = run_inprocess(module_config("federation.clients=3", "federation.rounds=1",
                                          module=LOOPS), grid=grid)
    assert summary["status"] == "failed"
    reasons = [u.reason for _, u in store.updates(summary["run_id"])]
    assert len(reasons) == 3 and all("cannot run the task module's own train()" in r
                                     for r in reasons), reasons


# ---- a stock Flower ClientApp, written as Flower's docs write one

def stock_client_app(*, load_server_weights: bool = True) -> ClientApp:
    """Its own model class and training loop (the task module's data, as Flower apps
    share a task.py); full weights back in an ArrayRecord, num-examples in metrics."""
    app = ClientApp()

    class Net(torch.nn.Sequential):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        if load_server_weights:
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        partition_id = context.node_config["partition-id"]
        num_partitions = context.node_config["num-partitions"]
        trainloader = DataLoader(my_task.load_partition(partition_id, num_partitions),
                                 batch_size=32, shuffle=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.train()
        running_loss = 0.0
        for x, y in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x.float()), y)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        model_record = ArrayRecord(model.state_dict())
        metrics = {"train_loss": running_loss / len(trainloader),
                   "num-examples": len(trainloader.dataset)}
        content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    return app


def test_a_stock_flower_client_app_trains_under_fedrings_server_on_the_modules_model(
        run_inprocess, store):
    summary = run_inprocess(module_config("federation.rounds=4"), stock_client_app())
    assert summary["status"] == "completed" and summary["versions"] == 4
    run_id = summary["run_id"]
    assert all(u.fate == "accepted" for _, u in store.updates(run_id))
    acc = accuracies(store, run_id)
    assert acc[0] < 0.5 and acc[-1] > 0.9, acc  # converges


def test_tensor_names_that_differ_are_named_in_the_stored_and_logged_reason(
        run_inprocess, store, caplog):
    """fedring's built-in MLP starts with Flatten (1.weight, 3.weight); the stock app's
    model does not (0.weight, 2.weight)."""
    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1"])
    with caplog.at_level(logging.WARNING):
        summary = run_inprocess(cfg, stock_client_app(load_server_weights=False))
    assert summary["status"] == "failed"
    reasons = [u.reason for _, u in store.updates(summary["run_id"])]
    expected = ("missing 1.weight, 1.bias, 3.weight, 3.bias; "
                "unexpected 0.weight, 0.bias, 2.weight, 2.bias")
    assert len(reasons) == 3 and all(expected in r for r in reasons), reasons
    assert sum(expected in rec.getMessage() for rec in caplog.records) == 3
