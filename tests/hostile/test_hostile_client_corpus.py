"""Malformed server messages: fedring's ClientApp answers each with an error reply that
names the problem, never raises, and stays able to train."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.app import MESSAGE_REFUSED
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_array, npy_view
from client.protocol.secagg import SecAggAction, SecAggKey, SecAggRecord
from client.protocol.updates import model_record
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

CONFIG = load_scenario("default", ["federation.clients=4", "train.local_epochs=1",
                                   "data.partitioner=iid"])
TASK = ScenarioTask.from_config(CONFIG)
PARAMS, LAYOUT = TASK.initial_params()
TASK_JSON = json.dumps(TASK.task_spec(), sort_keys=True)
FIRST = LAYOUT.names[0]
_ids = iter(range(1, 1 << 30))


@pytest.fixture(autouse=True, scope="module")
def _flower_identity() -> None:
    InProcessGrid(client_app, 1)  # sets the task identity Flower reads when making messages


def context() -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                   state=RecordDict(), run_config={})


def message(kind: str = "train", *, arrays: Any = "model", config: dict[str, Any] | None = None,
            drop: tuple[str, ...] = (), **records: Any) -> Message:
    """A server message as fedring's server sends it, with some parts replaced or dropped."""
    values = {"server-round": 1, ConfigKey.VERSION: 0, ConfigKey.REPLY: "delta",
              ConfigKey.TASK: TASK_JSON, ConfigKey.SEED: 0}
    values.update(config or {})
    content: dict[str, Any] = {
        "arrays": model_record(LAYOUT, PARAMS) if arrays == "model" else arrays,
        "config": ConfigRecord({k: v for k, v in values.items() if k not in drop}),
        **records}
    msg = Message(RecordDict({k: v for k, v in content.items() if k not in drop}), 1, kind,
                  group_id="1")
    msg.metadata.__dict__["_message_id"] = f"m{next(_ids)}"
    return msg


def model_with(change: Callable[[dict[str, Array]], None]) -> ArrayRecord:
    arrays = dict(model_record(LAYOUT, PARAMS).items())
    change(arrays)
    return ArrayRecord(arrays)


def _truncate(arrays: dict[str, Array]) -> None:
    a = arrays[FIRST]
    arrays[FIRST] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[:-4])


def _secagg(msg: bytes = b"SA\x01\x00", **settings: Any) -> ConfigRecord:
    values = {SecAggKey.RUN: 1, SecAggKey.ROUND: 1, SecAggKey.SCALE: 4.0, SecAggKey.CLIP: 1.0,
              SecAggKey.MAX_WEIGHT: 100.0, SecAggKey.WEIGHT_BY: "examples",
              SecAggKey.ROUNDING: "nearest", SecAggKey.DROPOUT: 0.0,
              SecAggKey.DROPOUT_STAGE: "random", SecAggKey.MSG: msg}
    values.update(settings)
    return ConfigRecord({k: v for k, v in values.items() if v is not None})


# (name, message, fragment of the error reply's reason)
CASES: list[tuple[str, Callable[[], Message], str]] = [
    ("no model arrays", lambda: message(drop=("arrays",)), "message has no ArrayRecord"),
    ("no config", lambda: message(drop=("config",)), "message has no ConfigRecord"),
    ("model is a config record", lambda: message(arrays=ConfigRecord({"w": 1})),
     "message has no ArrayRecord"),
    ("tensor of the wrong shape",
     lambda: message(arrays=model_with(lambda a: a.update({FIRST: npy_array(
         np.zeros(3, np.float32))}))), f"tensor '{FIRST}' has shape (3,), layout expects"),
    ("unknown tensor",
     lambda: message(arrays=model_with(lambda a: a.update(extra=npy_array(
         np.zeros(2, np.float32))))), "missing none; unexpected extra"),
    ("missing tensor", lambda: message(arrays=model_with(lambda a: a.pop(FIRST))),
     f"missing {FIRST}; unexpected none"),
    ("integer tensor",
     lambda: message(arrays=model_with(lambda a: a.update({FIRST: npy_array(
         np.zeros(npy_view(a[FIRST]).shape, np.int32))}))), "expected a float type"),
    ("truncated tensor bytes", lambda: message(arrays=model_with(_truncate)),
     "array payload has"),
    ("tensor in another serialization",
     lambda: message(arrays=model_with(lambda a: a.update({FIRST: Array(
         dtype="float32", shape=(1,), stype="torch.save", data=b"\0" * 4)}))),
     "array serialization 'torch.save' is not supported"),
    ("server-round is text", lambda: message(config={"server-round": "one"}),
     "config 'server-round' must be an integer, got 'one'"),
    ("server-round is a float", lambda: message(config={"server-round": 1.5}),
     "config 'server-round' must be an integer, got 1.5"),
    ("model version is text", lambda: message(config={ConfigKey.VERSION: "v0"}),
     "config 'fedring.version' must be an integer, got 'v0'"),
    ("reply kind is a number", lambda: message(config={ConfigKey.REPLY: 5}),
     "config 'fedring.reply' must be 'delta' when given, got 5"),
    ("task is bytes", lambda: message(config={ConfigKey.TASK: b"{}"}),
     "config 'fedring.task' must be a JSON string, got bytes"),
    ("task is not JSON", lambda: message(config={ConfigKey.TASK: "{not json"}),
     "config 'fedring.task' is not a task this client can build"),
    ("task lacks sections", lambda: message(config={ConfigKey.TASK: '{"seed": 0}'}),
     "config 'fedring.task' is not a task this client can build: task spec lacks"),
    ("task is null", lambda: message(config={ConfigKey.TASK: "null"}),
     "config 'fedring.task' is not a task this client can build"),
    ("evaluate without arrays", lambda: message("evaluate", drop=("arrays",)),
     "message has no ArrayRecord"),
    ("evaluate with a wrong shape",
     lambda: message("evaluate", arrays=model_with(lambda a: a.update({FIRST: npy_array(
         np.zeros((2, 2), np.float32))}))), f"tensor '{FIRST}' has shape (2, 2)"),
    ("secure round without its record", lambda: message(f"train.{SecAggAction.SECAGG}"),
     "message has no secure-aggregation payload"),
    ("secure setting of the wrong type",
     lambda: message(f"train.{SecAggAction.SECAGG}",
                     **{SecAggRecord.PROTOCOL: _secagg(**{SecAggKey.SCALE: "x"})}),
     f"secagg setting '{SecAggKey.SCALE}' is missing or not a float"),
    ("secure setting missing",
     lambda: message(f"train.{SecAggAction.SECAGG}",
                     **{SecAggRecord.PROTOCOL: _secagg(**{SecAggKey.RUN: None})}),
     f"secagg setting '{SecAggKey.RUN}' is missing"),
    ("garbage SETUP",
     lambda: message(f"train.{SecAggAction.SECAGG}",
                     **{SecAggRecord.PROTOCOL: _secagg(b"not a protocol message" * 2)}),
     "not a secure-aggregation message (bad magic)"),
    ("secure query without a session",
     lambda: message(f"query.{SecAggAction.SECAGG}", drop=("arrays", "config"),
                     **{SecAggRecord.PROTOCOL: ConfigRecord({SecAggKey.MSG: bytes.fromhex(
                         "5341010300000000000000000000000000000000000000000000000000")})}),
     "no secure-aggregation session"),
    ("secure query with a truncated message",
     lambda: message(f"query.{SecAggAction.SECAGG}", drop=("arrays", "config"),
                     **{SecAggRecord.PROTOCOL: ConfigRecord({SecAggKey.MSG: b"SA\x01"})}),
     "message truncated"),
]


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_message_gets_an_error_reply_naming_the_problem(make, fragment):
    msg = make()
    reply = client_app(msg, context())  # must not raise
    assert reply.has_error() and not reply.has_content()
    assert reply.error.code == MESSAGE_REFUSED
    assert reply.error.reason.startswith(f"{msg.metadata.message_type} message refused: ")
    assert fragment in reply.error.reason, reply.error.reason
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id


def _delta(reply: Message) -> np.ndarray:
    assert not reply.has_error(), reply.error.reason
    return np.array(npy_view(reply.content["delta"]["delta"]))


def test_client_trains_the_same_after_any_number_of_bad_messages():
    ctx = context()
    before = _delta(client_app(message(), ctx))
    for _, make, _ in CASES:
        assert client_app(make(), ctx).has_error()
    after = _delta(client_app(message(), ctx))
    np.testing.assert_array_equal(after, before)  # same seed, same model: same delta
    evaluated = client_app(message("evaluate"), ctx)
    assert not evaluated.has_error() and evaluated.content["metrics"]["eval_acc"] >= 0


_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.integers(2**62, 2**64),
                    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8),
                    st.lists(st.integers(-3, 3), max_size=3), st.just(TASK_JSON),
                    st.just("delta"))
_KEYS = ("server-round", ConfigKey.VERSION, ConfigKey.REPLY, ConfigKey.TASK, ConfigKey.SEED)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _values, min_size=1, max_size=3),
       kind=st.sampled_from(["train", "evaluate"]))
def test_any_config_values_give_a_reply_or_an_error_reply(changes, kind):
    drop = tuple(k for k, v in changes.items() if v is None)
    config = {k: v for k, v in changes.items() if v is not None}
    try:
        msg = message(kind, config=config, drop=drop)
    except (TypeError, ValueError):  # Flower refuses the value in a ConfigRecord itself
        return
    reply = client_app(msg, context())
    if reply.has_error():
        assert reply.error.code == MESSAGE_REFUSED and "message refused: config" in (
            reply.error.reason), reply.error.reason
    else:
        assert reply.content["metrics"][MetricKey.NUM_EXAMPLES] > 0
