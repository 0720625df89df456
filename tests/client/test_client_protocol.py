"""The message contract (client.protocol): the train config on the wire, answered by the real
ClientApp and decoded by the server's reply decoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from aggregation.compression import CompressionConfig
from client.protocol import keys, ring, secagg
from client.protocol.compression import CompressionRequest
from client.protocol.errors import WireError
from client.protocol.names import Names
from client.protocol.train import train_config
from client.protocol.updates import model_record
from server.replies import decode_train_reply
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

CONFIG = load_scenario("default", ["federation.clients=4", "train.local_epochs=1",
                                   "data.partitioner=iid"])
TASK = ScenarioTask.from_config(CONFIG)
PARAMS, LAYOUT = TASK.initial_params()
TASK_JSON = json.dumps(TASK.task_spec(), sort_keys=True)
KEY_CLASSES = [keys.RecordName, keys.ConfigKey, keys.MetricKey, keys.NodeConfigKey,
               secagg.SecAggAction, secagg.SecAggRecord, secagg.SecAggKey, ring.RingRecord,
               ring.RingKey, ring.RingMetric, ring.RingStatus]


def test_train_config_is_what_clients_already_read() -> None:
    # The keys and values deployed clients understand, spelled out here, not imported.
    assert dict(train_config(3, 7, '{"task": 1}', 11)) == {
        "server-round": 3, "fedring.version": 7, "fedring.reply": "delta",
        "fedring.task": '{"task": 1}', "fedring.seed": 11}


def test_train_config_carries_the_compression_request() -> None:
    request = CompressionRequest(CompressionConfig(kind="topk", fraction=0.1), run=5)
    config = train_config(1, 0, "{}", 0, compression=request.to_json())
    assert config["fedring.compression"] == request.to_json()
    assert CompressionRequest.from_config(config) == request
    assert CompressionRequest.from_config(train_config(1, 0, "{}", 0)) is None


def _train(config: ConfigRecord) -> Message:
    InProcessGrid(client_app, 1)  # sets the task identity Flower reads when making messages
    msg = Message(RecordDict({"arrays": model_record(LAYOUT, PARAMS), "config": config}), 1,
                  "train", group_id="1")
    msg.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    return client_app(msg, context)


def test_a_client_answers_the_train_config_with_a_delta_from_that_version() -> None:
    reply = _train(train_config(2, 5, TASK_JSON, 0))
    assert not reply.has_error(), reply.error
    update = decode_train_reply(reply, client_id="1", layout=LAYOUT, base_params=PARAMS,
                                version=5)
    assert update.base_version == 5 and update.delta.shape == (LAYOUT.dim,)
    assert np.abs(update.delta).max() > 0 and update.num_examples > 0
    with pytest.raises(WireError, match="trained from model version 5"):
        decode_train_reply(reply, client_id="1", layout=LAYOUT, base_params=PARAMS, version=4)


@pytest.mark.parametrize("names", KEY_CLASSES, ids=lambda c: c.__name__)
def test_key_classes_hold_distinct_plain_strings(names: type[Names]) -> None:
    values = [v for k, v in vars(names).items() if k.isupper()]
    assert values and all(type(v) is str for v in values)
    assert len(set(values)) == len(values)
    with pytest.raises(TypeError, match="cannot be instantiated"):
        names()
