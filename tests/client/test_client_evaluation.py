"""The client side of federated evaluation: a held-out split on every client, never
trained on, and the evaluate handler that measures the sent model (and, under FedBN, the
client's own) on it, through the real ClientApp on the in-process engine."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, RecordDict

import client.app
from client.app import make_client_app
from client.flat_model import FlatModel
from client.local_state import LOCAL_STATE, local_spans
from client.protocol.evaluation import evaluate_config, read_evaluation
from client.protocol.npy import npy_array
from client.protocol.train import train_config
from client.protocol.updates import model_record
from client.training import evaluate, train
from server.replies import decode_train_reply
from simulations.apps import client_app, spec_from_run_config
from simulations.config import load_scenario
from simulations.feature_shift import client_distortion
from simulations.inprocess import InProcessGrid
from simulations.module_task import make_task
from simulations.partitioners import client_test_split
from simulations.silo_engine import silo_client_app
from simulations.task import ScenarioTask, task_spec

CLIENTS = 3


def _config(*extra: str) -> dict[str, Any]:
    return load_scenario("default", [f"federation.clients={CLIENTS}", "train.local_epochs=1",
                                     *extra])


def _json(task: Any) -> str:
    return json.dumps(task.task_spec(), sort_keys=True)


def _call(app: Any, content: RecordDict, kind: str, node: int = 1, *,
          state: RecordDict | None = None) -> Message:
    """One message to ``app`` as the in-process engine delivers it to node ``node``
    (partition ``node - 1``); ``state``: the node's Context.state."""
    grid = InProcessGrid(app, CLIENTS)
    if state is not None:
        grid._contexts[node].state = state
    [msg_id] = grid.push_messages([Message(content, node, kind, group_id="1")])
    [reply] = grid.pull_messages([msg_id])
    return reply


def _train_delta(app: Any, task: Any, node: int = 1, params: np.ndarray | None = None
                 ) -> np.ndarray:
    start, layout = task.initial_params()
    params = start if params is None else params
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, _json(task), 0)})
    reply = _call(app, content, "train", node)
    assert not reply.has_error(), reply.error
    return decode_train_reply(reply, client_id=str(node), layout=layout, base_params=params,
                              version=1).delta.copy()


def _evaluate(app: Any, task: Any, params: np.ndarray, node: int = 1, *,
              fedbn: bool = False, state: RecordDict | None = None) -> Message:
    _, layout = task.initial_params()
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": evaluate_config(1, 1, _json(task), 0,
                                                    local_buffers=fedbn)})
    return _call(app, content, "evaluate", node, state=state)


def _moved(task: Any, seed: int = 3) -> np.ndarray:
    params, _ = task.initial_params()
    rng = np.random.default_rng(seed)
    return (params + 0.05 * rng.standard_normal(params.size)).astype(np.float32)


# ---- the split

@pytest.mark.parametrize("n", [1, 2, 3, 7, 50, 501])
@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.99])
def test_the_split_holds_out_at_least_one_and_trains_on_at_least_one(n, fraction):
    train_idx, held = client_test_split(n, fraction, 0, 4)
    assert sorted([*train_idx, *held]) == list(range(n))
    if n == 1:
        assert list(held) == [] and list(train_idx) == [0]
    else:
        assert 1 <= len(held) <= n - 1
        assert len(held) == min(max(round(fraction * n), 1), n - 1)
    assert np.array_equal(held, client_test_split(n, fraction, 0, 4)[1])  # seeded
    assert len(client_test_split(n, 0.0, 0, 4)[1]) == 0


def test_the_task_trains_on_the_rest_and_holds_out_its_split():
    task = ScenarioTask.from_config(_config())
    for pid in range(CLIENTS):
        idx = task.partitions()[pid]
        train_pos, held_pos = client_test_split(len(idx), 0.2, task.seed, pid)
        x, _ = task.partition(pid)
        xt, yt = task.client_test(pid)
        np.testing.assert_array_equal(x.numpy(), task.dataset.x_train[idx[train_pos]])
        np.testing.assert_array_equal(yt.numpy(), task.dataset.y_train[idx[held_pos]])
        assert len(x) + len(xt) == len(idx)
    none = ScenarioTask.from_config(_config("data.client_test_fraction=0"))
    assert none.client_test(0) is None
    assert len(none.partition(0)[0]) == len(none.partitions()[0])


# ---- the held-out split is never trained on

class Poisoned(ScenarioTask):
    """The scenario with every client's held-out split poisoned in the training set
    (huge inputs, shuffled labels); ``touch_training``: one training example changed."""

    touch_training = False

    @property
    def dataset(self):
        if getattr(self, "_poisoned", None) is None:
            ds = super().dataset
            x, y = ds.x_train.copy(), ds.y_train.copy()
            held = np.concatenate([self.split_indices(p)[1] for p in range(self.clients)])
            x[held] = 1e6
            y[held] = (y[held] + 1) % ds.num_classes
            if self.touch_training:
                x[self.split_indices(0)[0][0]] += 1.0
            self._poisoned = dataclasses.replace(ds, x_train=x, y_train=y)
        return self._poisoned


class TouchedTraining(Poisoned):
    touch_training = True


def test_poisoning_the_held_out_split_leaves_training_unchanged():
    config = _config("train.local_epochs=2")
    clean = ScenarioTask.from_config(config)
    client.app._WORKERS.clear()  # one task per worker key: start each from scratch
    want = _train_delta(client_app, clean)
    client.app._WORKERS.clear()
    poisoned = Poisoned(task_spec(config))
    assert float(poisoned.client_test(0)[0].abs().max()) == 1e6  # the poison is there
    got = _train_delta(make_client_app(Poisoned, spec_from_run_config), poisoned)
    np.testing.assert_array_equal(got, want)
    client.app._WORKERS.clear()
    touched = _train_delta(make_client_app(TouchedTraining, spec_from_run_config),
                           TouchedTraining(task_spec(config)))
    client.app._WORKERS.clear()
    assert not np.array_equal(touched, want)  # a training example does change it


POISONABLE = textwrap.dedent("""
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset
    from simulations.partitioners import client_test_split

    POISON = {poison}

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 3))

    def load_partition(partition_id, num_partitions):
        rng = np.random.default_rng(partition_id)
        x = rng.standard_normal((40, 4)).astype(np.float32)
        y = rng.integers(0, 3, 40)
        if POISON:
            _, held = client_test_split(40, 0.25, {seed}, partition_id)
            x[held] = 1e6
            y[held] = (y[held] + 1) % 3
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    {extra}
""")

OWN_TRAIN = textwrap.dedent("""
    def train(model, loader, config):
        assert model.training, "train() got the model in eval mode"
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {}
""")


@pytest.mark.parametrize("own_train", [False, True])
def test_a_module_tasks_held_out_split_is_never_trained_on(tmp_path, own_train):
    deltas = []
    seed = load_scenario("default")["seed"]
    for poison in (False, True):
        path = tmp_path / f"task_{poison}_{own_train}.py"
        path.write_text(POISONABLE.format(poison=poison, seed=seed,
                                          extra=OWN_TRAIN if own_train else ""))
        config = load_scenario("default", [f"federation.clients={CLIENTS}",
                                           f"task.module={path}",
                                           "task.client_test_fraction=0.25"])
        task = make_task(task_spec(config))
        assert (float(task.client_test(0)[0].abs().max()) == 1e6) == poison
        deltas.append(_train_delta(client_app, task))
    np.testing.assert_array_equal(deltas[0], deltas[1])
    assert np.any(deltas[0] != 0)


# ---- the evaluate handler

def test_evaluate_replies_the_sent_models_figures_on_the_held_out_split():
    task = ScenarioTask.from_config(_config())
    params = _moved(task)
    for node in (1, 3):
        pid = node - 1
        reply = _evaluate(client_app, task, params, node)
        assert not reply.has_error(), reply.error
        got = read_evaluation(reply.content["metrics"])
        idx = task.partitions()[pid]
        _, held = client_test_split(len(idx), 0.2, task.seed, pid)
        x = torch.from_numpy(task.dataset.x_train[idx[held]])
        y = torch.from_numpy(task.dataset.y_train[idx[held]])
        model = FlatModel(task.build_model())
        model.load(params)
        loss, acc = evaluate(model.module, x, y)
        assert got.num_examples == len(held) == round(0.2 * len(idx))
        assert got.loss == pytest.approx(loss, rel=1e-6) and got.accuracy == acc
        assert not got.personal
        train_loss, _ = evaluate(model.module, *task.partition(pid))
        assert got.loss != pytest.approx(train_loss, rel=1e-6)  # not a training figure


def test_a_client_without_a_held_out_split_refuses_naming_the_key():
    task = ScenarioTask.from_config(_config("data.client_test_fraction=0"))
    reply = _evaluate(client_app, task, _moved(task))
    assert reply.has_error()
    assert "has no held-out split: set data.client_test_fraction > 0" in reply.error.reason


def test_an_evaluation_leaves_training_as_it_was(monkeypatch):
    """An evaluate message between two train messages changes neither the next training
    (the model is back in train mode, the cached global model untouched) nor a reply the
    server still holds (the model trained in its buffer, in place)."""
    monkeypatch.setattr(client.app, "IN_PLACE_MIN_DIM", 0)
    config = _config("model.kind=bn_mlp", "model.hidden=[16]")
    task = ScenarioTask.from_config(config)
    client.app._WORKERS.clear()
    params, layout = task.initial_params()
    grid = InProcessGrid(client_app, CLIENTS)

    def send(content: RecordDict, kind: str) -> Message:
        [msg_id] = grid.push_messages([Message(content, 1, kind, group_id="1")])
        [reply] = grid.pull_messages([msg_id])
        assert not reply.has_error(), reply.error
        return reply

    record = model_record(layout, params)
    train_msg = RecordDict({"arrays": record, "config": train_config(1, 1, _json(task), 0)})
    held = decode_train_reply(send(train_msg, "train"), client_id="1", layout=layout,
                              base_params=params, version=1).delta
    first = held.copy()
    send(RecordDict({"arrays": model_record(layout, _moved(task)),
                     "config": evaluate_config(1, 1, _json(task), 0)}), "evaluate")
    worker = next(iter(client.app._WORKERS.values()))
    assert worker.model.module.training
    np.testing.assert_array_equal(held, first)  # the reply the server holds
    again = decode_train_reply(send(train_msg, "train"), client_id="1", layout=layout,
                               base_params=params, version=1).delta
    np.testing.assert_array_equal(again, first)
    client.app._WORKERS.clear()


def test_train_puts_a_model_left_in_eval_mode_back_in_train_mode():
    task = ScenarioTask.from_config(_config("model.kind=bn_mlp", "model.hidden=[16]"))
    x, y = task.partition(0)
    deltas = []
    for mode in ("train", "eval"):
        model = FlatModel(task.build_model())
        getattr(model.module, mode)()
        start = model.flat_np.copy()
        train(model.module, x, y, task.train_config, seed=5)
        deltas.append(model.flat_np - start)
    np.testing.assert_array_equal(deltas[0], deltas[1])


# ---- FedBN: the client's own model too

def test_fedbn_measures_the_clients_own_batch_norm_beside_the_global_model():
    task = ScenarioTask.from_config(_config("model.kind=bn_mlp", "model.hidden=[16]",
                                            "aggregation.local_buffers=true"))
    params = _moved(task)
    model = FlatModel(task.build_model())
    rng = np.random.default_rng(9)
    own = {}
    views = model.layout.unflatten(params)
    for name, _ in local_spans(model):  # the node's own batch norm, set by hand
        value = views[name] + rng.normal(0.0, 0.5, views[name].shape).astype(np.float32)
        own[name] = np.abs(value) if name.endswith("running_var") else value
    state = RecordDict({LOCAL_STATE: ArrayRecord({k: npy_array(v) for k, v in own.items()})})
    reply = _evaluate(client_app, task, params, node=2, fedbn=True, state=state)
    assert not reply.has_error(), reply.error
    got = read_evaluation(reply.content["metrics"])
    x, y = task.client_test(1)
    model.load(params)
    loss, acc = evaluate(model.module, x, y)
    personal = params.copy()
    for name, span in local_spans(model):
        personal[span] = own[name].ravel()
    model.load(personal)
    loss_p, acc_p = evaluate(model.module, x, y)
    assert got.loss == pytest.approx(loss, rel=1e-6) and got.accuracy == acc
    assert got.loss_personal == pytest.approx(loss_p, rel=1e-6)
    assert got.accuracy_personal == acc_p
    assert got.loss_personal != pytest.approx(got.loss, rel=1e-3)
    # without FedBN's flag, or without state of its own, only the global figures
    plain = read_evaluation(_evaluate(client_app, task, params, node=2, state=state)
                            .content["metrics"])
    assert not plain.personal and plain.loss == got.loss
    fresh = read_evaluation(_evaluate(client_app, task, params, node=2, fedbn=True)
                            .content["metrics"])
    assert not fresh.personal


def test_a_silo_answers_evaluate_messages_the_same_way():
    task = ScenarioTask.from_config(_config())
    params = _moved(task)
    want = read_evaluation(_evaluate(client_app, task, params, 2).content["metrics"])
    silo = silo_client_app(ScenarioTask, spec_from_run_config)
    reply = _evaluate(silo, task, params, 2)
    assert not reply.has_error(), reply.error
    assert read_evaluation(reply.content["metrics"]) == want


# ---- module tasks

MODULE = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(3, 2))

    def _data(seed, n):
        g = torch.Generator().manual_seed(seed)
        return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))

    def load_partition(partition_id, num_partitions):
        return _data(partition_id, 20)
    {extra}
""")
OWN_TEST = textwrap.dedent("""
    def load_client_test(partition_id, num_partitions):
        return _data(100 + partition_id, 7)
""")


def _module_task(tmp_path: Path, extra: str, *settings: str) -> Any:
    path = tmp_path / f"mod_{abs(hash((extra, settings)))}.py"
    path.write_text(MODULE.format(extra=extra))
    return make_task(task_spec(load_scenario("default", [
        f"federation.clients={CLIENTS}", f"task.module={path}", *settings])))


def test_a_module_tasks_load_client_test_is_its_held_out_split(tmp_path):
    task = _module_task(tmp_path, OWN_TEST)
    task.check()
    params = _moved(task)
    got = read_evaluation(_evaluate(client_app, task, params, 2).content["metrics"])
    x, y = task.module._data(101, 7).tensors
    model = FlatModel(task.build_model())
    model.load(params)
    loss, acc = evaluate(model.module, x, y)
    assert got.num_examples == 7
    assert got.loss == pytest.approx(loss, rel=1e-6) and got.accuracy == acc
    assert len(task.partition(1)[0]) == 20  # the whole partition is trained on


def test_a_module_tasks_partition_is_split_by_client_test_fraction(tmp_path):
    task = _module_task(tmp_path, "", "task.client_test_fraction=0.3")
    params = _moved(task)
    got = read_evaluation(_evaluate(client_app, task, params, 3).content["metrics"])
    x, y = task.module._data(2, 20).tensors
    train_idx, held = client_test_split(20, 0.3, task.seed, 2)
    model = FlatModel(task.build_model())
    model.load(params)
    loss, acc = evaluate(model.module, x[held], y[held])
    assert got.num_examples == len(held) == 6
    assert got.loss == pytest.approx(loss, rel=1e-6) and got.accuracy == acc
    np.testing.assert_array_equal(task.partition(2)[0].numpy(), x[train_idx].numpy())
    none = _module_task(tmp_path, "")  # the default: none held out
    assert none.client_test(0) is None
    reply = _evaluate(client_app, none, params, 1)
    assert reply.has_error() and "has no held-out split" in reply.error.reason


def test_the_modules_own_evaluate_runs_on_the_held_out_split(tmp_path):
    own = textwrap.dedent("""
        def evaluate(model, loader):
            n = sum(len(y) for _, y in loader)
            return {"loss": float(n), "accuracy": 0.5, "seen": 2.0 * n}
    """)
    task = _module_task(tmp_path, OWN_TEST + own)
    metrics = _evaluate(client_app, task, _moved(task), 1).content["metrics"]
    got = read_evaluation(metrics)
    assert (got.num_examples, got.loss, got.accuracy) == (7, 7.0, 0.5)
    assert metrics["eval_seen"] == 14.0  # the module's own figure passes through


@pytest.mark.parametrize("extra, settings, message", [
    ("def load_client_test(partition_id, num_partitions):\n    return 3\n", (),
     r"load_client_test\(\) returned int for partition 0, expected a torch.utils.data.Dataset"),
    ("def load_client_test(partition_id):\n    return None\n", (),
     r"load_client_test\(\) must take \(partition_id, num_partitions\)"),
    (OWN_TEST, ("task.client_test_fraction=0.2",),
     r"load_client_test\(\) gives each client's held-out split.*set "
     r"task.client_test_fraction = 0"),
])
def test_a_bad_load_client_test_fails_at_start_naming_it(tmp_path, extra, settings, message):
    from simulations.module_task import TaskModuleError

    with pytest.raises(TaskModuleError, match=message) as info:
        _module_task(tmp_path, extra, *settings).check()
    assert "mod_" in str(info.value)  # names the module


# ---- feature shift

def test_feature_shift_moves_each_clients_inputs_by_its_own_affine_map():
    clean = ScenarioTask.from_config(_config())
    config = _config("data.feature_shift=0.5")
    spec = task_spec(config)
    assert spec["data"]["feature_shift"] == 0.5 and spec["data"]["client_test_fraction"] == 0.2
    shifted = ScenarioTask(spec)
    sd = float(np.std(clean.dataset.x_train, dtype=np.float64))
    maps = set()
    for pid in range(CLIENTS):
        log_contrast, shift = client_distortion(0.5, clean.seed, pid)
        a, b = np.exp(log_contrast), shift * sd
        for part in ("partition", "client_test"):
            x0, y0 = getattr(clean, part)(pid)
            x1, y1 = getattr(shifted, part)(pid)
            np.testing.assert_allclose(x1.numpy(), a * x0.numpy() + b, rtol=1e-5, atol=1e-5)
            assert torch.equal(y0, y1)
        maps.add((round(a, 6), round(b, 6)))
    assert len(maps) == CLIENTS  # each client its own map
    test_clean, test_shifted = clean.load_test().tensors, shifted.load_test().tensors
    assert torch.equal(test_clean[0], test_shifted[0])  # the central test set untouched
    params, _ = clean.initial_params()
    assert clean.evaluate(params) == shifted.evaluate(params)


class Tokens(ScenarioTask):
    """The scenario with integer inputs (as a token dataset has)."""

    @property
    def dataset(self):
        ds = super().dataset
        return dataclasses.replace(ds, x_train=ds.x_train.astype(np.int64))


def test_feature_shift_refuses_token_inputs():
    with pytest.raises(ValueError, match=r"data\.feature_shift distorts real-valued"):
        Tokens(task_spec(_config("data.feature_shift=0.5"))).check()
    Tokens(task_spec(_config())).check()


def test_a_modules_own_train_gets_the_model_in_train_mode_after_an_evaluation(tmp_path):
    path = tmp_path / "own_train.py"
    path.write_text(POISONABLE.format(poison=False, seed=0, extra=OWN_TRAIN))
    task = make_task(task_spec(load_scenario("default", [
        f"federation.clients={CLIENTS}", f"task.module={path}",
        "task.client_test_fraction=0.25"])))
    params, layout = task.initial_params()
    grid = InProcessGrid(client_app, CLIENTS)
    for kind, config in (("evaluate", evaluate_config(1, 1, _json(task), 0)),
                         ("train", train_config(1, 1, _json(task), 0))):
        content = RecordDict({"arrays": model_record(layout, params), "config": config})
        [msg_id] = grid.push_messages([Message(content, 1, kind, group_id="1")])
        [reply] = grid.pull_messages([msg_id])
        assert not reply.has_error(), reply.error  # (train() asserts model.training)
