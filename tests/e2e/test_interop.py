"""Interoperability with plain Flower apps, in both directions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from client.training import evaluate
from simulations.apps import client_app
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

SHIFT = 0.01


def stock_flower_client_app() -> ClientApp:
    """A ClientApp written the way Flower's tutorials write one: full weights back."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        state = msg.content["arrays"].to_torch_state_dict()
        shifted = {k: v + SHIFT for k, v in state.items()}  # a known "training" step
        content = RecordDict({"arrays": ArrayRecord(shifted),
                              "metrics": MetricRecord({"num-examples": 10, "train_loss": 0.5})})
        return Message(content, reply_to=msg)

    return app


def test_fedring_server_accepts_stock_flower_replies(small_config, run_inprocess, store):
    cfg = {**small_config, "federation": {**small_config["federation"], "rounds": 1}}
    summary = run_inprocess(cfg, stock_flower_client_app())
    updates = store.updates(summary["run_id"], round=1)
    assert [u.fate for _, u in updates] == ["accepted"] * 5
    initial, _ = ScenarioTask.from_config(cfg).initial_params()
    final = store.load_checkpoint(summary["run_id"]).params
    # every client moved every weight by SHIFT, so the FedAvg of the deltas is SHIFT
    np.testing.assert_allclose(final - initial, SHIFT, atol=1e-6)


def test_fedring_client_under_flower_fedavg(small_config):
    task = ScenarioTask.from_config(small_config)
    model = task.build_model()
    initial = ArrayRecord(model.state_dict())
    scenario = {"scenario": "default", "federation.clients": 5, "train.local_epochs": 2}
    grid = InProcessGrid(client_app, 5, run_config=scenario)
    result = FedAvg(fraction_evaluate=1.0).start(
        grid=grid, initial_arrays=initial, num_rounds=2, train_config=ConfigRecord({}))
    final_state = result.arrays.to_torch_state_dict()
    model.load_state_dict(final_state)
    x = torch.from_numpy(task.dataset.x_test)
    y = torch.from_numpy(task.dataset.y_test)
    accuracy = float((model(x).argmax(1) == y).float().mean())
    assert accuracy > 0.7, accuracy
    assert result.train_metrics_clientapp[2]["train_loss"] < \
        result.train_metrics_clientapp[1]["train_loss"]
    assert result.evaluate_metrics_clientapp[2]["eval_acc"] > 0.7


def test_flower_fedavgs_evaluate_messages_are_answered_on_the_held_out_split(small_config):
    """Flower's FedAvg asks every client to evaluate the aggregated model; each fedring
    ClientApp answers on its held-out split, and FedAvg's example-weighted mean is that of
    the figures computed here on the splits."""
    task = ScenarioTask.from_config(small_config)
    model = task.build_model()
    scenario = {"scenario": "default", "federation.clients": 5, "train.local_epochs": 1}
    grid = InProcessGrid(client_app, 5, run_config=scenario)
    result = FedAvg(fraction_evaluate=1.0).start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=1,
        train_config=ConfigRecord({}))
    model.load_state_dict(result.arrays.to_torch_state_dict())
    counts, losses, accs = [], [], []
    for pid in range(5):
        x, y = task.client_test(pid)
        loss, acc = evaluate(model, x, y)
        counts.append(len(y))
        losses.append(loss)
        accs.append(acc)
    assert sum(counts) < sum(len(task.partitions()[pid]) for pid in range(5)) / 4
    got = result.evaluate_metrics_clientapp[1]
    assert got["eval_acc"] == pytest.approx(np.average(accs, weights=counts), rel=1e-6)
    assert got["eval_loss"] == pytest.approx(np.average(losses, weights=counts), rel=1e-5)
