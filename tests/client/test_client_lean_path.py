"""The lean per-client path: one optimizer per worker reset for each client, the global
model flattened once per round, and in-process records copied without re-checking."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from client.flat_model import FlatModel
from client.protocol.train import train_config
from client.protocol.updates import model_record
from client.training import TrainConfig, make_optimizer, train
from server.replies import decode_train_reply
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid, _private_records
from simulations.task import ScenarioTask

OPTIMIZERS = [TrainConfig(optimizer="sgd", momentum=0.9, lr=0.05, local_epochs=2),
              TrainConfig(optimizer="sgd", momentum=0.5, weight_decay=1e-3, lr=0.05),
              TrainConfig(optimizer="adam", lr=0.01, local_epochs=2)]


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(),
                                         torch.nn.Linear(8, 3)))


def _clients() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen))
            for n in (40, 23, 57)]


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=["momentum", "weight-decay", "adam"])
def test_a_reused_optimizer_trains_each_client_as_a_fresh_one(cfg: TrainConfig) -> None:
    fresh, reused = _model(), _model()
    start = fresh.flat.clone()
    opt = make_optimizer(list(reused.module.parameters()), cfg)
    for i, (x, y) in enumerate(_clients()):
        fresh.flat.copy_(start)
        reused.flat.copy_(start)
        loss_fresh = train(fresh.module, x, y, cfg, seed=i)
        loss_reused = train(reused.module, x, y, cfg, seed=i, optimizer=opt)
        assert loss_fresh == loss_reused
        assert torch.equal(fresh.flat, reused.flat), f"client {i} differs"
        assert opt.state  # the state a client built is there until the next one starts


CONFIG = load_scenario("default", ["federation.clients=3", "train.local_epochs=1",
                                   "data.partitioner=iid", "train.momentum=0.9"])
TASK = ScenarioTask.from_config(CONFIG)
TASK_JSON = json.dumps(TASK.task_spec(), sort_keys=True)


def _grid_call(grid: InProcessGrid, content: RecordDict, node: int, kind: str) -> Message:
    [msg_id] = grid.push_messages([Message(content, node, kind, group_id="1")])
    [reply] = grid.pull_messages([msg_id])
    assert not reply.has_error(), reply.error
    return reply


def _train(grid: InProcessGrid, node: int, rnd: int = 1, record=None) -> np.ndarray:
    """The delta of ``node``'s reply to a train message carrying ``record`` (by default the
    initial model): a view of the reply's own buffer (nothing copied)."""
    params, layout = TASK.initial_params()
    record = model_record(layout, params) if record is None else record
    content = RecordDict({"arrays": record, "config": train_config(rnd, rnd, TASK_JSON, 0)})
    reply = _grid_call(grid, content, node, "train")
    return decode_train_reply(reply, client_id=str(node), layout=layout, base_params=params,
                              version=rnd).delta


def _send(record, node: int, rnd: int) -> np.ndarray:
    """``_train`` on a fresh engine, the delta copied out of its reply."""
    return _train(InProcessGrid(client_app, 3), node, rnd, record).copy()


def test_deltas_are_against_the_model_each_message_carries() -> None:
    """The worker keeps the last record flattened; a new record (a new round's model) is
    read again, and a client trains from it, not from the previous round's model."""
    params, layout = TASK.initial_params()
    first = model_record(layout, params)
    moved = params + np.float32(0.25)
    second = model_record(layout, moved)
    a = _send(first, 1, 1)
    b = _send(second, 1, 1)  # same client and seed, another model
    again = _send(first, 1, 1)
    assert np.array_equal(a, again)  # back on the first record: the same training
    assert not np.array_equal(a, b)
    # ``b`` equals training from ``moved`` directly, as a fresh model would
    model = FlatModel(TASK.build_model())
    model.load(moved)
    x, y = TASK.partition(0)
    from client.app import training_seed
    train(model.module, x, y, TASK.train_config, seed=training_seed(TASK.seed, 1, 0))
    np.testing.assert_array_equal(b, model.flat_np - moved)


def test_in_process_records_are_private_copies() -> None:
    config = ConfigRecord({"a": 1, "b": "x"})
    metrics = MetricRecord({"m": 1.5})
    content = RecordDict({"config": config, "metrics": metrics})
    copy = _private_records(content)
    copy["config"].pop("a")
    copy["metrics"]["m"] = 2.0
    copy["config"]["c"] = 3
    assert dict(config) == {"a": 1, "b": "x"} and dict(metrics) == {"m": 1.5}
    assert type(copy["config"]) is ConfigRecord and type(copy["metrics"]) is MetricRecord
    with pytest.raises(TypeError):  # the copy still checks what is put into it
        copy["config"]["d"] = object()


def test_a_message_still_runs_when_the_worker_model_was_left_in_eval_mode() -> None:
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    params, layout = TASK.initial_params()
    InProcessGrid(client_app, 1)
    msg = Message(RecordDict({"arrays": model_record(layout, params),
                              "config": train_config(1, 1, TASK_JSON, 0)}), 1, "train",
                  group_id="1")
    msg.metadata.__dict__["_message_id"] = "m1"
    from client.app import _WORKERS
    client_app(msg, ctx)
    worker = next(iter(_WORKERS.values()))
    worker.model.module.eval()
    client_app(msg, ctx)
    assert worker.model.module.training


# ---- a large model trains in its reply's buffer and makes its delta there in place


@pytest.fixture
def in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    import client.app

    monkeypatch.setattr(client.app, "IN_PLACE_MIN_DIM", 0)  # the test model is small


def _worker():
    from client.app import _WORKERS

    return _WORKERS[TASK_JSON]


def test_an_in_place_delta_is_the_copying_paths_delta_in_the_models_own_buffer(
        in_place: None) -> None:
    grid = InProcessGrid(client_app, 3)
    delta = _train(grid, 2)
    assert np.shares_memory(delta, _worker().model.flat_np)  # made where the model trained
    import client.app

    client.app.IN_PLACE_MIN_DIM = 1 << 62  # (the fixture puts it back)
    copied = _train(grid, 2)
    assert not np.shares_memory(copied, _worker().model.flat_np)
    np.testing.assert_array_equal(delta, copied)
    assert np.any(delta != 0)


def test_a_reply_the_server_holds_is_never_written_by_later_messages(in_place: None) -> None:
    """A robust combine keeps every delta until the round ends: neither the next client's
    training nor an evaluation on the same worker may write into the buffer it holds."""
    grid = InProcessGrid(client_app, 3)
    held = _train(grid, 1)
    kept = held.copy()
    other = _train(grid, 2)
    assert not np.shares_memory(held, other)
    np.testing.assert_array_equal(held, kept)
    params, layout = TASK.initial_params()
    evaluation = RecordDict({"arrays": model_record(layout, params + np.float32(0.5)),
                             "config": ConfigRecord({"fedring.task": TASK_JSON})})
    reply = _grid_call(grid, evaluation, 3, "evaluate")
    assert reply.content["metrics"]["num-examples"] > 0
    np.testing.assert_array_equal(held, kept)
    np.testing.assert_array_equal(other, _train(grid, 2))  # and training goes on the same


def test_in_place_deltas_give_the_same_run_when_the_server_holds_every_reply(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """An omniscient attack (ALIE) holds a round's decoded replies until the last one."""
    import client.app
    from simulations.cli import run_simulation

    evaluated: list[np.ndarray] = []
    evaluate = ScenarioTask.evaluate

    def keep(task: ScenarioTask, params: np.ndarray) -> dict[str, float]:
        evaluated.append(params.copy())  # the server's model after each round
        return evaluate(task, params)

    monkeypatch.setattr(ScenarioTask, "evaluate", keep)
    runs = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(client.app, "IN_PLACE_MIN_DIM", threshold)
        evaluated.clear()
        config = load_scenario("default", ["federation.clients=5", "federation.rounds=2",
                                           "attack.kind=alie", "attack.fraction=0.4"])
        run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / f'{threshold}.db'}")
        runs.append(list(evaluated))
    assert len(runs[1]) == 3  # the initial model and two rounds
    assert not np.array_equal(runs[1][0], runs[1][-1])
    for before, after in zip(*runs, strict=True):
        np.testing.assert_array_equal(before, after)


def test_a_model_stays_in_its_buffer_once_the_server_dropped_the_reply_made_there(
        in_place: None) -> None:
    """The next client trains where the last one did when nothing holds that reply any
    more, and moves to another buffer while anything does: the reply, a view of its
    delta, or a view of the model's vector."""
    grid = InProcessGrid(client_app, 3)
    first = _train(grid, 1)
    kept = first.copy()
    worker = _worker()
    where = worker.model.flat_np.ctypes.data
    second = _train(grid, 2)  # ``first`` (a view of the first reply) is alive: moved
    np.testing.assert_array_equal(first, kept)
    assert not np.shares_memory(first, second)
    del first
    moved_to = worker.model.flat_np.ctypes.data
    assert moved_to != where
    third = _train(grid, 3)  # ``second`` is alive: moved back to the free first buffer
    assert worker.model.flat_np.ctypes.data == where
    del second, third
    _train(grid, 1).copy()  # nothing holds the third reply: trained where it was made
    assert worker.model.flat_np.ctypes.data == where
    view = worker.model.flat_np[:4]  # a view of the model's vector, as a LocalUpdate holds
    before = view.copy()
    _train(grid, 2).copy()
    assert worker.model.flat_np.ctypes.data != where
    np.testing.assert_array_equal(view, before)


def test_an_in_process_round_moves_the_model_once(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path) -> None:
    """A FedAvg round drops each reply once it is added (the engine and the server keep no
    reference while the next client trains), so the model trains in one reply buffer."""
    import client.app
    from client.flat_model import FlatModel as Flat
    from simulations.cli import run_simulation

    client.app._WORKERS.clear()  # a fresh worker, in no reply buffer yet
    moves = []
    rebind = Flat.rebind
    monkeypatch.setattr(Flat, "rebind", lambda self, v: moves.append(1) or rebind(self, v))
    monkeypatch.setattr(client.app, "IN_PLACE_MIN_DIM", 0)
    config = load_scenario("default", ["federation.clients=6", "federation.rounds=3"])
    run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / 'r.db'}")
    assert len(moves) == 1, len(moves)  # into its first reply buffer, of 18 trainings
