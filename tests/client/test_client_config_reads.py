"""The ClientApp reads its train config from the record's entries: every setting as
before (malformed ones refused with the same reason), and a whole in-process run stores
each update's fate: a rejected update's reason, an empty round's, a crashed client's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from client.app import FedringClient, record_of
from client.protocol.errors import WireError
from client.protocol.train import train_config
from client.protocol.updates import model_record
from server.replies import decode_train_reply
from server.store import Store
from simulations.apps import client_app
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

SETTINGS = ["federation.clients=4", "train.local_epochs=1", "data.partitioner=iid"]
TASK = ScenarioTask.from_config(load_scenario("default", SETTINGS))
PARAMS, LAYOUT = TASK.initial_params()
TASK_JSON = json.dumps(TASK.task_spec(), sort_keys=True)


def _train(config: ConfigRecord, name: str = "config") -> Message:
    InProcessGrid(client_app, 1)  # sets the task identity Flower reads when making messages
    msg = Message(RecordDict({"arrays": model_record(LAYOUT, PARAMS), name: config}), 1,
                  "train", group_id="1")
    msg.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 2, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    return client_app(msg, context)


def _config(**changes: Any) -> ConfigRecord:
    entries = dict(train_config(3, 5, TASK_JSON, 0))
    entries.update(changes)
    return ConfigRecord({k: v for k, v in entries.items() if v is not None})


def test_every_setting_is_read_from_the_config() -> None:
    reply = _train(_config())
    assert not reply.has_error(), reply.error
    metrics = dict(next(v for k, v in reply.content.items() if k != "delta"))
    assert metrics["fedring.base-version"] == 5 and metrics["fedring.partition-id"] == 2
    assert metrics["num-examples"] > 0 and "train_loss" in metrics
    update = decode_train_reply(reply, client_id="3", layout=LAYOUT, base_params=PARAMS,
                                version=5)
    assert update.num_examples == metrics["num-examples"]
    # a config under another name is found as before; the same training seed: the same delta
    other = _train(_config(), name="settings")
    again = decode_train_reply(other, client_id="3", layout=LAYOUT, base_params=PARAMS,
                               version=5)
    assert (again.delta == update.delta).all()


@pytest.mark.parametrize(("changes", "reason"), [
    ({"fedring.reply": "weights"}, "config 'fedring.reply' must be 'delta' when given, got "
                                   "'weights'"),
    ({"fedring.local-buffers": 1}, "config 'fedring.local-buffers' must be a boolean, got 1"),
    ({"server-round": 2.5}, "config 'server-round' must be an integer, got 2.5"),
    ({"fedring.version": True}, "config 'fedring.version' must be an integer, got True"),
    ({"fedring.task": 7}, "config 'fedring.task' must be a JSON string, got int"),
])
def test_a_malformed_setting_is_refused_with_its_reason(changes: dict[str, Any],
                                                        reason: str) -> None:
    reply = _train(_config(**changes))
    assert reply.has_error() and reply.error.code == 400
    assert reply.error.reason == f"train message refused: {reason}"


def test_record_of_prefers_the_named_record_then_the_first_of_its_kind() -> None:
    config, other = ConfigRecord({"a": 1}), ConfigRecord({"b": 2})
    assert record_of(RecordDict({"x": other, "config": config}), ConfigRecord, "config") \
        is config
    assert record_of(RecordDict({"x": other}), ConfigRecord, "config") is other
    with pytest.raises(WireError, match="message has no ConfigRecord"):
        record_of(RecordDict({}), ConfigRecord, "config")


def _run(tmp_path, *settings: str) -> tuple[dict[str, Any], list, list]:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    summary = run_simulation(load_scenario("default", [*SETTINGS, *settings]),
                             engine="inprocess", db=url)
    with Store(url) as store:  # (round 0: the initial model's evaluation)
        rounds = [r for r in store.rounds(summary["run_id"]) if r.round > 0]
        return summary, rounds, store.updates(summary["run_id"])


def test_a_rejected_update_keeps_its_reason(tmp_path) -> None:
    _, rounds, updates = _run(tmp_path, "federation.rounds=1", "aggregation.max_norm=10",
                              "attack.kind=scale", "attack.scale=1000", "attack.fraction=0.25")
    fates = [u.fate for _, u in updates]
    assert sorted(fates) == ["accepted"] * 3 + ["rejected"] and rounds[0].num_accepted == 3
    [rejected] = [u for _, u in updates if u.fate == "rejected"]
    assert "exceeds max_norm 10" in rejected.reason and rejected.norm > 10


def test_an_empty_round_stores_every_reason_and_applies_nothing(tmp_path) -> None:
    _, rounds, updates = _run(tmp_path, "federation.rounds=1",
                              "aggregation.max_norm=1e-9")
    assert [r.status for r in rounds] == ["failed"] and rounds[0].num_accepted == 0
    assert rounds[0].model_version == 0
    assert len(updates) == 4 and all(u.fate == "rejected" and "exceeds max_norm" in u.reason
                                     for _, u in updates)


def test_a_crashed_client_is_rejected_with_its_error(tmp_path, monkeypatch) -> None:
    train = FedringClient._local_training

    def crash_on_partition_1(self, worker, pid, *args: Any) -> Any:
        if pid == 1:
            raise RuntimeError("disk on fire")
        return train(self, worker, pid, *args)

    monkeypatch.setattr(FedringClient, "_local_training", crash_on_partition_1)
    _, rounds, updates = _run(tmp_path, "federation.rounds=2")
    assert [r.status for r in rounds] == ["completed"] * 2
    assert [r.num_accepted for r in rounds] == [3, 3]
    crashed = [u for _, u in updates if u.fate == "rejected"]
    assert len(crashed) == 2 and all(u.client_id == "2" for u in crashed)
    assert all("RuntimeError: disk on fire" in u.reason for u in crashed)
