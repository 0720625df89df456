"""Each Flower internal that ``client.protocol.flower_compat`` relies on still does what it
did in Flower 1.41: an attribute set through a helper is what Flower's public API reads, and
every internal function still takes the parameters the helper passes.

A failure here means a Flower upgrade changed an internal: fix the helper named by the test.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from client.protocol import flower_compat as fc


@pytest.fixture(autouse=True)
def _keep_task_identity():
    """Restore the process's task identity, which some tests here set."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _internal(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _takes(path: str, *args, **kwargs) -> None:
    """The Flower function at ``path`` accepts these arguments (as the helper passes them)."""
    inspect.signature(_internal(path)).bind(*args, **kwargs)


def _fields(message_class: str) -> set[str]:
    return set(_internal(message_class).DESCRIPTOR.fields_by_name)


# Records --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [ArrayRecord, ConfigRecord, MetricRecord, RecordDict])
def test_record_entries_is_the_live_entry_dict(kind) -> None:
    value = {ArrayRecord: Array(np.zeros(2, np.float32)), ConfigRecord: "v",
             MetricRecord: 1.5, RecordDict: ConfigRecord({"a": 1})}[kind]
    record = kind()
    entries = fc.record_entries(record)
    assert entries == {}, "Flower's records no longer keep their entries in __dict__['_data']"
    record["k"] = value
    assert entries == {"k": value} and list(record.keys()) == ["k"]
    entries["j"] = value  # what the fast paths write is what the record reads
    assert record["j"] is value and len(record) == 2
    assert fc.record_entries(record.copy()) is not entries
    assert fc.record_entries(type("NotARecord", (), {})()) is None


@pytest.mark.parametrize(("kind", "entries"), [
    (MetricRecord, {"num-examples": 3, "loss": 0.5}),
    (ArrayRecord, {"w": Array(np.arange(3, dtype=np.float32))}),
    (RecordDict, {"m": MetricRecord({"a": 1}), "c": ConfigRecord({"b": "x"})}),
])
def test_record_from_entries_makes_the_constructors_record(kind, entries) -> None:
    assert fc._EMPTY[kind] is not None, "Flower's record layout changed: fast path off"
    record = fc.record_from_entries(kind, entries)
    built = kind(dict(entries)) if kind is not ArrayRecord else kind()
    if kind is ArrayRecord:
        for name, value in entries.items():
            built[name] = value
    assert type(record) is kind and record == built and dict(record) == dict(built)
    lazy = {"_is_dirty"}  # a flag Flower adds on first change or hash
    assert set(record.__dict__) - lazy == set(built.__dict__) - lazy
    record[next(iter(entries))] = next(iter(entries.values()))  # a working, own record
    assert fc.record_from_entries(kind, {}) is not fc.record_from_entries(kind, {})
    assert fc.record_entries(fc._EMPTY[kind]) == {}  # the shared empty one stays empty


@pytest.mark.parametrize("record", [ConfigRecord({"a": 1, "b": b"xy"}),
                                    MetricRecord({"loss": 0.25})])
def test_copy_record_is_an_independent_equal_record(record) -> None:
    copy = fc.copy_record(record)
    assert type(copy) is type(record) and copy == record and copy is not record
    copy.pop(next(iter(record.keys())))
    assert len(record) == len(copy) + 1
    assert sorted(copy.__dict__) == sorted(type(record)().__dict__)


def test_array_from_fields_is_the_constructors_array() -> None:
    assert fc._ARRAY_LAYOUT_KNOWN, "Flower's Array layout changed: fast path off"
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    built = Array(data)
    arr = fc.array_from_fields(built.dtype, built.shape, built.stype, built.data)
    assert type(arr) is Array and arr == built
    np.testing.assert_array_equal(arr.numpy(), data)
    assert arr.object_id == built.object_id and arr.deflate() == built.deflate()
    view = fc.array_from_fields("float32", (2, 3), built.stype, memoryview(built.data))
    np.testing.assert_array_equal(view.numpy(), data)  # any bytes-like buffer works


# Message metadata and identity ------------------------------------------------------------

def test_set_message_id_and_sender_are_what_metadata_returns() -> None:
    fc.set_task_identity(task_id=1, run_id=1, node_id=fc.SUPERLINK_NODE_ID)
    message = Message(RecordDict(), dst_node_id=3, message_type="train")
    fc.set_message_id(message, "m7")
    fc.set_sender(message, run_id=42, src_node_id=fc.SUPERLINK_NODE_ID)
    meta = message.metadata
    assert (meta.message_id, meta.run_id, meta.src_node_id) == ("m7", 42, fc.SUPERLINK_NODE_ID)
    reply = Message(RecordDict(), reply_to=message)
    assert reply.metadata.reply_to_message_id == "m7"  # replies point at the id set here


def test_task_identity_is_what_new_messages_read() -> None:
    fc.set_task_identity(task_id=9, run_id=8, node_id=fc.SUPERLINK_NODE_ID)
    meta = Message(RecordDict(), dst_node_id=2, message_type="train").metadata
    assert (meta.run_id, meta.src_node_id) == (8, fc.SUPERLINK_NODE_ID)
    assert fc.SUPERLINK_NODE_ID == 1


def test_empty_run_is_the_grids_run_type() -> None:
    run = fc.empty_run(5)
    assert isinstance(run, fc.Run) and run.run_id == 5
    assert inspect.signature(Grid.set_run).parameters["run"].annotation in ("Run", fc.Run)


def test_error_codes_and_sub_statuses() -> None:
    from flwr.clientapp.client_app import LoadClientAppError

    assert fc.client_app_error_code(LoadClientAppError("x")) == \
        fc.ErrorCode.LOAD_CLIENT_APP_EXCEPTION
    assert fc.client_app_error_code(ValueError("x")) == fc.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert (fc.SubStatus.COMPLETED, fc.SubStatus.FAILED) == ("completed", "failed")
    assert inspect.signature(fc.ClientAppCallable.__call__) is not None


# The Runtime API (the warm executor) --------------------------------------------------------

def test_runtime_requests() -> None:
    from flwr.supercore.constant import TaskType

    assert list(fc.acquire_task_request().supported_task_types) == [TaskType.CLIENT_APP]
    assert fc.task_heartbeat_request().ByteSize() == 0
    assert {"task_id", "run", "context", "fab"} <= _fields(
        "flwr.proto.runtime_pb2.PullTaskInputResponse")
    assert {"messages_list", "message_object_trees"} <= _fields(
        "flwr.proto.runtime_pb2.PullAppMessagesResponse")
    assert "object_id" in _fields("flwr.proto.message_pb2.ObjectTree")


def test_runtime_client_has_the_calls_the_executor_makes() -> None:
    client = fc.runtime_client("127.0.0.1:9", insecure=True, root_certificates=None,
                               component="flwr-clientapp", token="t")
    try:
        for call in ("AcquireTask", "PullTaskInput", "PullMessages", "PullObject",
                     "ConfirmMessageReceived", "SendTaskHeartbeat", "close"):
            assert callable(getattr(client, call)), call
        assert [type(i).__name__ for i in client._interceptors] == [
            "RuntimeVersionHttpInterceptor", "RuntimeTokenHttpInterceptor"]
    finally:
        client.close()
    control = fc.runtime_client("127.0.0.1:9", insecure=True, root_certificates=None,
                                component="SuperExec")
    assert [type(i).__name__ for i in control._interceptors] == [
        "RuntimeVersionHttpInterceptor"]
    control.close()


def test_pull_task_input_internals_take_our_arguments() -> None:
    for name in ("context_from_proto", "run_from_proto", "fab_from_proto"):
        _takes(f"flwr.common.serde.{name}", object())
    _takes("flwr.supercore.inflatable.inflatable_protobuf_utils.make_pull_object_fn_protobuf",
           object(), object(), 1)
    _takes("flwr.supercore.inflatable.inflatable_protobuf_utils."
           "make_confirm_message_received_fn_protobuf", object(), object(), 1)
    _takes("flwr.supercore.inflatable.inflatable_utils.pull_and_inflate_object_from_tree",
           object(), object(), object(), return_type=Message, initial_backoff=0.1,
           backoff_cap=0.1)
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("task_id", "run_id", "node_id"):  # settable, readable class properties
        assert isinstance(getattr(type(TaskIdentity), name), property), name


def test_push_and_load_internals_take_our_arguments() -> None:
    _takes("flwr.supernode.runtime.run_clientapp.push_message", object(), object(), object())
    _takes("flwr.supernode.runtime.run_clientapp.push_task_output", client=object(),
           context=None, sub_status="failed", details="")
    _takes("flwr.common.config.get_project_dir", "fab", "1.0", "hash")
    _takes("flwr.cli.install.install_from_fab", b"", skip_prompt=True)
    _takes("flwr.clientapp.utils.get_load_client_app_fn", default_app_ref="", app_path=None,
           multi_app=True)
    _takes("flwr.supercore.app_utils.start_parent_process_monitor", 1)


# The SuperNode's loop ---------------------------------------------------------------------

def test_supernode_loop_sleeps_as_the_shim_expects() -> None:
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    assert f"time.sleep({fc.FLOWER_IDLE_SLEEP_S:g})" in source
    assert f"time.sleep({fc.FLOWER_REPLY_SLEEP_S:g})" in source
    _takes("flwr.supernode.start_client_internal.pull_objects", object(), object(),
           initial_backoff=0.1, backoff_cap=1.0)


def test_shorten_supernode_waits_replaces_the_loops_sleep() -> None:
    import time

    from flwr.supernode import start_client_internal as loop

    slept: list[float] = []
    saved_time, saved_pull = loop.time, loop.pull_objects
    try:
        fc.shorten_supernode_waits(slept.append, initial_backoff=0.05, backoff_cap=1.0)
        loop.time.sleep(3)
        assert slept == [3] and loop.time.monotonic is time.monotonic
        assert loop.pull_objects.func is saved_pull
        assert loop.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 1.0}
    finally:
        loop.time, loop.pull_objects = saved_time, saved_pull


def test_supernode_command_internals() -> None:
    _takes("flwr.supercore.logger.update_console_handler", timestamps=True, colored=False)
    _takes("flwr.supernode.cli.flower_supernode.flower_supernode")


# The simulation engine and Flower's configuration --------------------------------------------

def test_run_simulation_internal_takes_our_arguments() -> None:
    from flwr.supercore.telemetry import EventType

    _takes("flwr.simulation.run_simulation._run_simulation", num_supernodes=2,
           server_app=object(), client_app=object(), backend_name="ray", backend_config={},
           exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE)


def test_flower_config_round_trip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert fc.flwr_home() == tmp_path
    fc.write_superlink_connection("fed-a", "127.0.0.1:9093", root_certificates=None)
    fc.write_superlink_connection("fed-b", "10.0.0.1:9093", root_certificates="/ca.pem")
    config = fc.read_flower_config()
    assert config["superlink"]["fed-a"]["address"] == "127.0.0.1:9093"
    assert config["superlink"]["fed-a"]["insecure"] is True
    assert config["superlink"]["fed-b"]["root-certificates"] == "/ca.pem"
    del config["superlink"]["fed-a"]
    fc.write_flower_config(config)
    assert "fed-a" not in fc.read_flower_config()["superlink"]
    assert (tmp_path / "config.toml").is_file()
    from flwr.cli.flower_config import read_superlink_connection

    assert read_superlink_connection("fed-b").address == "10.0.0.1:9093"


def test_register_node_internals_take_our_arguments() -> None:
    _takes("flwr.cli.utils.init_http_client_from_connection", object())
    assert "public_key" in _fields("flwr.proto.control_pb2.RegisterNodeRequest")
    assert "node_id" in _fields("flwr.proto.control_pb2.RegisterNodeResponse")


def test_context_type_is_public() -> None:
    assert Context is importlib.import_module("flwr.app").Context


# The warm executor's connection and the SuperNode's wake-up ---------------------------------

def test_share_connection_sends_through_the_owners_pool() -> None:
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskResponse
    from flwr.supercore.constant import TASK_TOKEN_HEADER

    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=AcquireTaskResponse(token="t1").SerializeToString())

    owner = fc.runtime_client("127.0.0.1:9", insecure=True, root_certificates=None,
                              component="SuperExec")
    owner.__dict__["_client"].close()
    owner.__dict__["_client"] = pool = httpx.Client(transport=httpx.MockTransport(answer))
    task = fc.runtime_client("127.0.0.1:9", insecure=True, root_certificates=None,
                             component="flwr-clientapp", token="secret")
    own = task.__dict__["_client"]
    fc.share_connection(task, owner)
    assert task.__dict__["_client"] is pool and own.is_closed
    assert task.AcquireTask(fc.acquire_task_request()).token == "t1"
    assert seen and seen[-1].headers[TASK_TOKEN_HEADER] == "secret"  # the task's own token
    owner.AcquireTask(fc.acquire_task_request())
    assert TASK_TOKEN_HEADER not in seen[-1].headers
    pool.close()


def test_on_supernode_message_calls_back_once_a_message_is_stored() -> None:
    from flwr.supernode import start_client_internal as loop

    assert "_pull_and_store_message(" in inspect.getsource(loop.start_client_internal)
    source = inspect.getsource(loop._pull_and_store_message)
    assert source.index("confirm_message_received(") < source.rindex("return run_id")
    saved = loop._pull_and_store_message
    results, calls = iter([None, 7, None]), []
    try:
        loop._pull_and_store_message = lambda **_: next(results)
        fc.on_supernode_message(lambda: calls.append("woken"))
        fc.on_supernode_message(lambda: calls.append("again"))  # replaces, never stacks
        got = [loop._pull_and_store_message(state=None) for _ in range(3)]
        assert got == [None, 7, None] and calls == ["again"]
    finally:
        loop._pull_and_store_message = saved
