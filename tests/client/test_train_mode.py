"""A user's ``train()`` always starts with the model in train mode, also right after the
client evaluated it (dropout and batch norm behave differently in eval mode)."""

from __future__ import annotations

import textwrap

import torch
from flwr.app import Context, RecordDict

from client.app import measure
from client.flat_model import FlatModel
from client.protocol.updates import model_record
from simulations.apps import build_task
from simulations.cli import run_simulation
from simulations.config import load_scenario

TASK = textwrap.dedent("""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset

    MODES = {modes!r}

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(8, 2))

    def load_partition(partition_id, num_partitions):
        g = torch.Generator().manual_seed(partition_id)
        return TensorDataset(torch.randn(20, 3, generator=g), torch.tensor([0, 1] * 10))

    def train(model, loader, config):
        with open(MODES, "a") as f:
            f.write("train " if model.training else "eval ")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return {{}}
""")


def _module(tmp_path):
    modes = tmp_path / "modes.txt"
    path = tmp_path / "dropout_task.py"
    path.write_text(TASK.format(modes=str(modes)))
    return path, modes


def test_train_after_each_rounds_federated_evaluation_sees_train_mode(tmp_path):
    path, modes = _module(tmp_path)
    config = load_scenario("default", [
        "federation.clients=2", "federation.rounds=3", f"task.module={path}",
        "task.client_test_fraction=0.25", "federation.evaluate_fraction=1",
        "federation.evaluate_every=1"])
    summary = run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path}/r.db")
    assert summary["status"] == "completed"
    seen = modes.read_text().split()
    assert len(seen) == 6 and set(seen) == {"train"}, seen  # 2 clients x 3 rounds


def test_the_modules_train_is_handed_a_model_in_train_mode(tmp_path):
    path, modes = _module(tmp_path)
    config = load_scenario("default", ["federation.clients=2", f"task.module={path}"])
    task = build_task(config)
    model = task.build_model().eval()  # as a previous evaluation would leave it
    task._train_with_module(model, 0, seed=1)
    assert modes.read_text().split() == ["train"]


def test_measuring_leaves_the_model_in_train_mode():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5))
    model = FlatModel(module)
    held = (torch.randn(8, 3), torch.tensor([0, 1] * 4))
    record = model_record(model.layout, model.flat_np.copy())
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    evaluation, _ = measure(None, model, record, 0, held, context, fedbn=False)
    assert evaluation.num_examples == 8
    assert module.training
