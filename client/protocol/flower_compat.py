"""Every use of a Flower private name or internal module, behind small named functions.

fedring otherwise uses only Flower's public API (``flwr.app``, ``flwr.serverapp``,
``flwr.clientapp``). Each function here names the Flower internal it relies on; all were
checked against Flower 1.41, and tests/architecture/test_flower_compat.py fails when a
Flower release changes one of them. It lives in ``client.protocol`` because the server,
the client and the simulations may all import it; the heavy internal modules (the
Runtime API, the SuperNode, the CLI, the simulation engine) are imported inside the
functions that need them, so importing this module costs only ``flwr.app``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import (
    Array,
    ArrayRecord,
    Context,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode, SubStatus
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = [
    "FLOWER_IDLE_SLEEP_S",
    "FLOWER_REPLY_SLEEP_S",
    "SUPERLINK_NODE_ID",
    "ClientAppCallable",
    "ErrorCode",
    "Run",
    "SubStatus",
    "acquire_task_request",
    "array_from_fields",
    "client_app_error_code",
    "copy_record",
    "customize_supernode_app",
    "empty_run",
    "flwr_home",
    "load_client_app",
    "on_supernode_message",
    "pull_task_input",
    "push_reply",
    "push_task_output",
    "read_flower_config",
    "record_entries",
    "record_from_entries",
    "register_node",
    "replace_superlink_middleware",
    "reply_message",
    "run_flower_superlink",
    "run_flower_supernode",
    "run_simulation",
    "runtime_client",
    "set_message_id",
    "set_sender",
    "set_task_identity",
    "share_connection",
    "shorten_grid_object_retries",
    "shorten_supernode_waits",
    "start_parent_process_monitor",
    "task_heartbeat_request",
    "trivial_http_dependencies",
    "write_flower_config",
    "write_superlink_connection",
]

R = TypeVar("R", MetricRecord, ArrayRecord, RecordDict)

# Records -------------------------------------------------------------------------------

_ENTRIES = "_data"  # flwr.app.message.typeddict.TypedDict: entries in __dict__["_data"]


def record_entries(record: Any) -> dict[Any, Any] | None:
    """The dict a Flower record keeps its entries in, or None if it keeps none there.

    Relies on ``flwr.app.message.typeddict.TypedDict`` (the base of every record and of
    ``RecordDict``) storing its entries in ``__dict__["_data"]`` (Flower 1.41)."""
    data = record.__dict__.get(_ENTRIES)
    return data if isinstance(data, dict) else None


def _empty(kind: type[R]) -> R | None:
    """An empty ``kind`` whose entries live in a dict that ``copy`` copies, or None."""
    empty = kind()
    copy = getattr(empty, "copy", None)
    data = record_entries(empty)
    if copy is None or data is None or record_entries(copy()) is data:
        return None
    return empty


_EMPTY: dict[type, Any] = {kind: _empty(kind) for kind in (MetricRecord, ArrayRecord, RecordDict)}


def record_from_entries(kind: type[R], entries: Mapping[str, Any]) -> R | None:
    """A ``kind`` (MetricRecord, ArrayRecord or RecordDict) holding ``entries`` as they
    are, without Flower's check of each; None when Flower's layout is not the known one.

    Relies on ``TypedDict.copy`` copying ``__dict__["_data"]`` and on setting that dict
    making the object Flower's constructor makes (Flower 1.41)."""
    empty = _EMPTY[kind]
    if empty is None:
        return None
    record = empty.copy()
    record.__dict__[_ENTRIES] = dict(entries)
    return record


def copy_record(record: Any) -> Any:
    """A copy of a Config or Metric record with its own entry dict, made without checking
    the entries again. Relies on ``TypedDict``'s ``__dict__["_data"]`` (Flower 1.41)."""
    entries = record_entries(record)
    if entries is None:
        return type(record)(dict(record))
    copy = object.__new__(type(record))
    copy.__dict__.update(record.__dict__)
    copy.__dict__[_ENTRIES] = dict(entries)
    return copy


_ARRAY_FIELDS = ("dtype", "shape", "stype", "data")


def _array_layout_known() -> bool:
    """Whether Flower's Array keeps exactly its four fields in ``__dict__`` (lazily adding
    its ``_is_dirty`` flag and caches)."""
    probe = Array("float32", (1,), "numpy.ndarray", b"\0" * 4)
    return set(probe.__dict__) - {"_is_dirty"} == set(_ARRAY_FIELDS)


_ARRAY_LAYOUT_KNOWN = _array_layout_known()


def array_from_fields(dtype: str, shape: tuple[int, ...], stype: str,
                      data: Any) -> Array | None:
    """The ``Array`` Flower's constructor makes of these fields, made without its checks
    (``data`` may be any bytes-like buffer); None when Flower's layout is not the known one.

    Relies on ``flwr.app.Array`` keeping ``dtype``, ``shape``, ``stype`` and ``data`` in
    its ``__dict__`` and adding ``_is_dirty`` lazily (Flower 1.41)."""
    if not _ARRAY_LAYOUT_KNOWN:
        return None
    arr = object.__new__(Array)
    arr.__dict__.update(dtype=dtype, shape=shape, stype=stype, data=data)
    return arr


# Message metadata and identity --------------------------------------------------------

_METADATA_FIELDS = frozenset((
    "_run_id", "_message_id", "_src_node_id", "_dst_node_id", "_src_task_id",
    "_dst_task_id", "_reply_to_message_id", "_group_id", "_created_at", "_ttl",
    "_message_type", "_delivered_at"))


def _reply_layout_known() -> bool:
    """Whether Flower's Message and Metadata keep exactly the fields ``reply_message``
    sets in their ``__dict__``."""
    sent = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1,
                    reply_to_message_id="", group_id="", created_at=time.time(), ttl=60.0,
                    message_type="train")
    probe = Message(RecordDict(), metadata=sent)
    reply = Message(RecordDict(), reply_to=probe)
    return (set(reply.__dict__) == {"_metadata", "_content", "_error"}
            and set(reply.metadata.__dict__) == _METADATA_FIELDS)


_REPLY_LAYOUT_KNOWN = _reply_layout_known()


def reply_message(content: RecordDict, reply_to: Message) -> Message:
    """``Message(content, reply_to=reply_to)`` with every field Flower's constructor sets,
    made without its argument parsing and checks (``content`` must be a RecordDict); the
    constructor itself when Flower's layout is not the known one.

    Relies on ``Message`` keeping ``_metadata``, ``_content`` and ``_error`` and
    ``Metadata`` its fields in ``__dict__`` (Flower 1.41), and on a reply's TTL being
    what is left of its request's when none is given (``_limit_reply_ttl``)."""
    if not _REPLY_LAYOUT_KNOWN or type(content) is not RecordDict:
        return Message(content, reply_to=reply_to)
    sent = reply_to.metadata.__dict__
    current = time.time()  # flwr.supercore.date.now().timestamp()
    meta = object.__new__(Metadata)
    meta.__dict__.update(
        _run_id=sent["_run_id"], _message_id="", _src_node_id=sent["_dst_node_id"],
        _dst_node_id=sent["_src_node_id"], _src_task_id=sent["_dst_task_id"],
        _dst_task_id=sent["_src_task_id"], _reply_to_message_id=sent["_message_id"],
        _group_id=sent["_group_id"], _created_at=current,
        _ttl=sent["_created_at"] + sent["_ttl"] - current,
        _message_type=sent["_message_type"], _delivered_at="")
    reply = object.__new__(Message)
    reply.__dict__.update(_metadata=meta, _content=content, _error=None)
    return reply


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` the id ``message.metadata.message_id`` returns, as a SuperLink or
    ``flwr-clientapp`` does. Relies on ``Metadata.__dict__["_message_id"]`` (Flower 1.41)."""
    message.metadata.__dict__["_message_id"] = message_id


def set_sender(message: Message, run_id: int, src_node_id: int) -> None:
    """Set the run and sending node a SuperLink stamps on a pushed message. Relies on
    ``Metadata.__dict__["_run_id"]`` and ``["_src_node_id"]`` (Flower 1.41)."""
    meta = message.metadata.__dict__
    meta["_run_id"] = run_id
    meta["_src_node_id"] = src_node_id


def empty_run(run_id: int) -> Run:
    """A ``Run`` with only its id, what a Grid holds before ``set_run``. Relies on
    ``flwr.supercore.run.Run.create_empty`` (Flower 1.41; ``Grid.run`` returns a ``Run``)."""
    return Run.create_empty(run_id)


def set_task_identity(task_id: int, run_id: int, node_id: int) -> None:
    """The identity new Messages read their run and source node from, as Flower's runtimes
    set it before running an app. Relies on ``flwr.supercore.task_identity.TaskIdentity``
    (Flower 1.41)."""
    TaskIdentity.task_id = task_id
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id


# The Runtime API of a SuperNode (the warm executor) ---------------------------------

def task_heartbeat_request() -> Any:
    """``flwr.proto.runtime_pb2.SendTaskHeartbeatRequest()`` (Flower 1.41)."""
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    return SendTaskHeartbeatRequest()


def acquire_task_request() -> Any:
    """A request claiming a ClientApp task: ``flwr.proto.runtime_pb2.AcquireTaskRequest``
    for ``flwr.supercore.constant.TaskType.CLIENT_APP`` (Flower 1.41)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    return AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])


def runtime_client(address: str, *, insecure: bool, root_certificates: bytes | None,
                   component: str, token: str | None = None,
                   interceptors: tuple[Any, ...] = ()) -> Any:
    """A Runtime API client as ``flwr-clientapp`` makes one, naming ``component`` (and with
    a task ``token``), with ``interceptors`` after Flower's. Relies on
    ``flwr.supercore.runtime.RuntimeHttpClient``, ``flwr.supercore.interceptors`` and
    ``flwr.supercore.retry`` (Flower 1.41)."""
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    chain: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        chain.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=root_certificates,
        interceptors=[*chain, *interceptors], retry_invoker=make_simple_http_retry_invoker())


def share_connection(client: Any, owner: Any) -> None:
    """Make the Runtime API ``client`` send through ``owner``'s connection pool, so that a
    client made per task reuses ``owner``'s open (TLS) connection instead of opening one;
    ``client`` must then not be closed (that would close ``owner``'s pool). Relies on
    ``flwr.supercore.protobuf.client.ProtobufClient`` sending every call through its
    ``httpx.Client`` in ``_client`` (Flower 1.41)."""
    shared = owner.__dict__["_client"]
    own = client.__dict__.get("_client")
    if own is not None and own is not shared:
        own.close()
    client.__dict__["_client"] = shared


def pull_task_input(client: Any, backoff_s: float) -> tuple[Any, Any, Any, Any]:
    """``flwr-clientapp``'s pull of the task's Message, Context, Run and FAB, retrying a
    message object that is not there yet after ``backoff_s`` rather than Flower's 1 s.

    Relies on ``flwr.common.serde``, ``flwr.proto`` and ``flwr.supercore.inflatable``
    (``pull_and_inflate_object_from_tree``), on ``TaskIdentity`` and on the message id
    being the object id of its tree (Flower 1.41)."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context, run, fab = (context_from_proto(res.context), run_from_proto(res.run),
                         fab_from_proto(res.fab))
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("no message for this task on the Runtime API")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node,
                                                  context.run_id),
        return_type=Message, initial_backoff=backoff_s, backoff_cap=max(backoff_s, 0.1))
    set_message_id(message, tree.object_id)  # as flwr-clientapp does
    return message, context, run, fab


def client_app_error_code(exc: BaseException) -> int:
    """The error code ``flwr-clientapp`` replies with when running the app raised ``exc``.
    Relies on ``flwr.clientapp.client_app.LoadClientAppError`` (Flower 1.41)."""
    from flwr.clientapp.client_app import LoadClientAppError

    return (ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(exc, LoadClientAppError)
            else ErrorCode.CLIENT_APP_RAISED_EXCEPTION)


def push_reply(client: Any, reply: Message, context: Context) -> None:
    """Send the ClientApp's reply and context back to the SuperNode. Relies on
    ``flwr.supernode.runtime.run_clientapp.push_message`` (Flower 1.41)."""
    from flwr.supernode.runtime.run_clientapp import push_message

    push_message(client, reply, context)


def push_task_output(client: Any, context: Context | None, sub_status: str,
                     details: str) -> None:
    """Report the task's end (a ``SubStatus``). Relies on
    ``flwr.supernode.runtime.run_clientapp.push_task_output`` (Flower 1.41)."""
    from flwr.supernode.runtime.run_clientapp import push_task_output as push

    push(client=client, context=context, sub_status=sub_status, details=details)


def load_client_app(run: Any, fab: Any) -> tuple[Callable[..., Any], Path]:
    """The run's ClientApp and its project folder, installing the FAB when that folder has
    no ``pyproject.toml``. Relies on ``flwr.common.config.get_project_dir``,
    ``flwr.cli.install.install_from_fab`` and ``flwr.clientapp.utils.get_load_client_app_fn``
    (Flower 1.41)."""
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.config import get_project_dir

    app_dir = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str))
    if not (app_dir / "pyproject.toml").is_file():  # the path is unique to this FAB
        install_from_fab(fab.content, skip_prompt=True)
    loader = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    return loader(run.fab_id, run.fab_version, fab.hash_str), app_dir


def start_parent_process_monitor(parent_pid: int) -> None:
    """SIGINT this process once ``parent_pid`` is gone. Relies on
    ``flwr.supercore.app_utils.start_parent_process_monitor`` (Flower 1.41)."""
    from flwr.supercore.app_utils import start_parent_process_monitor as start

    start(parent_pid)


# The SuperNode's loop ---------------------------------------------------------------

FLOWER_IDLE_SLEEP_S = 3.0  # start_client_internal's sleep after a pull that found nothing
FLOWER_REPLY_SLEEP_S = 0.5  # its steps while waiting for the ClientApp's reply


def shorten_supernode_waits(sleep: Callable[[float], None], initial_backoff: float,
                            backoff_cap: float) -> None:
    """Make the SuperNode loop sleep with ``sleep`` and retry a message object not yet on
    the SuperLink after ``initial_backoff`` (doubling up to ``backoff_cap``).

    Relies on ``flwr.supernode.start_client_internal`` using the module-level ``time``
    (``time.sleep(3)`` and ``time.sleep(0.5)``) and ``pull_objects`` (Flower 1.41)."""
    import functools
    import time
    import types

    from flwr.supernode import start_client_internal as loop

    if getattr(loop, "time", None) is not time:
        raise RuntimeError("flwr.supernode.start_client_internal no longer uses the time "
                           "module; this wrapper does not support this Flower version")
    shim = types.ModuleType("time")
    shim.__dict__.update(time.__dict__)
    shim.sleep = sleep  # type: ignore[attr-defined]
    loop.time = shim  # type: ignore[attr-defined]
    loop.pull_objects = functools.partial(  # type: ignore[attr-defined]
        loop.pull_objects, initial_backoff=initial_backoff, backoff_cap=backoff_cap)


def on_supernode_message(callback: Callable[[], None]) -> None:
    """Call ``callback`` each time the SuperNode loop has pulled a message and stored it
    with all its objects, so that its ClientApp task can be claimed and run at once.

    Relies on ``flwr.supernode.start_client_internal`` calling its module-level
    ``_pull_and_store_message``, which returns a run id once it stored a message (with
    its task and objects) and None when it stored none (Flower 1.41)."""
    from flwr.supernode import start_client_internal as loop

    def pull_and_call(pull: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            run_id = pull(*args, **kwargs)
            if run_id is not None:
                callback()
            return run_id
        return call

    _patch_once(loop, "_pull_and_store_message", pull_and_call)


def _calls(module: Any, function: str, name: str) -> bool:
    """Whether ``module.function`` exists and its code uses ``name``."""
    code = getattr(getattr(module, function, None), "__code__", None)
    return code is not None and name in code.co_names


def _patch_once(module: Any, name: str,
                make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.name`` by ``make(original)``, where ``original`` is Flower's
    function even when an earlier call patched it already (patching twice wraps once)."""
    import functools

    current = getattr(module, name)
    original = getattr(current, "__wrapped__", current)
    setattr(module, name, functools.wraps(original)(make(original)))


#: The longest wait between two pulls of a message object not yet on the SuperLink, on
#: both sides: the ServerApp's Grid (``server.grid_io``) and the SuperNode
#: (``client.supernode``).
OBJECT_RETRY_CAP_S = 0.2


def shorten_grid_object_retries(initial_backoff: float, backoff_cap: float) -> bool:
    """Make a deployment's Grid retry a reply's object not yet on the SuperLink after
    ``initial_backoff`` (doubling up to ``backoff_cap``) instead of 1 s (up to 10 s).

    The SuperLink lists a reply as soon as the SuperNode has sent its head, before the
    SuperNode has pushed its objects, so a pull can catch it half there. Only the HTTP
    Grid (``flwr-serverapp``'s) calls the patched function; when its module is not loaded
    nothing is patched and False is returned. Relies on ``flwr.superlink.grid.http_grid``
    calling its module-level ``pull_objects`` (Flower 1.41)."""
    import functools
    import sys

    grid = sys.modules.get("flwr.superlink.grid.http_grid")
    if grid is None:
        return False
    pull = getattr(grid.pull_objects, "func", grid.pull_objects)  # once patched: the original
    grid.pull_objects = functools.partial(  # type: ignore[attr-defined]
        pull, initial_backoff=initial_backoff, backoff_cap=backoff_cap)
    return True


def run_flower_supernode(argv: list[str], *, colored: bool) -> None:
    """Run the ``flower-supernode`` command with ``argv``, logging with timestamps. Relies
    on ``flwr.supernode.cli.flower_supernode`` and ``flwr.supercore.logger`` (Flower 1.41)."""
    import sys

    from flwr.supercore.logger import update_console_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    update_console_handler(timestamps=True, colored=colored)
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def customize_supernode_app(customize: Callable[[Any], None]) -> None:
    """Pass every Runtime API app the SuperNode creates (where its ClientApp executor
    connects) through ``customize(app)`` before it serves. Raises RuntimeError at once
    when this Flower starts that API otherwise.

    Relies on ``flwr.supernode.cli.flower_supernode._start_supernode_http_api`` importing
    ``create_app`` from ``flwr.supernode.main`` when it starts the API (Flower 1.41)."""
    import importlib

    from flwr.supernode import main

    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")  # not the function
    if not hasattr(main, "create_app") or not _calls(cli, "_start_supernode_http_api",
                                                     "create_app"):
        raise RuntimeError("flwr.supernode no longer starts its Runtime API with "
                           "flwr.supernode.main.create_app; fedring's SuperNode wrapper does "
                           "not support this Flower version")

    def customized(create: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            app = create(*args, **kwargs)
            customize(app)
            return app
        return call

    _patch_once(main, "create_app", customized)


# The SuperLink's HTTP app ------------------------------------------------------------

def replace_superlink_middleware(transform: Callable[[list[Any]], list[Any]]) -> None:
    """Make the SuperLink's app use ``transform(middleware)`` for Flower's middleware list
    (Starlette ``Middleware`` entries, outermost first). Raises RuntimeError at once when
    this Flower builds its app otherwise.

    Relies on ``flwr.superlink.main.create_app`` taking its middleware from the
    module-level ``_get_middleware()`` (Flower 1.41)."""
    from flwr.superlink import main

    if not hasattr(main, "_get_middleware") or not _calls(main, "create_app",
                                                          "_get_middleware"):
        raise RuntimeError("flwr.superlink.main no longer builds its middleware with "
                           "_get_middleware(); this SuperLink wrapper does not support this "
                           "Flower version")
    _patch_once(main, "_get_middleware",
                lambda original: lambda: transform(list(original())))


def trivial_http_dependencies() -> tuple[tuple[Callable[..., Any], ...], tuple[type, ...]]:
    """The request dependencies of Flower's HTTP apps (the SuperLink's Fleet, Runtime and
    Control routes; the SuperNode's Runtime routes) that only read the app's state or the request
    (no I/O, no lock): functions, and classes whose instances are dependencies. Relies
    on ``get_linkstate``, ``get_runtime_state``, ``get_runtime_handlers``,
    ``get_protobuf_request``, ``flwr.superlink.routers.fleet.router.get_enable_supernode_auth``
    and ``VersionDependency`` (Flower 1.41)."""
    from flwr.supercore.dependencies.runtime import get_runtime_handlers, get_runtime_state
    from flwr.supercore.dependencies.version import VersionDependency
    from flwr.supercore.protobuf.translation import get_protobuf_request
    from flwr.superlink.dependencies.linkstate import get_linkstate
    from flwr.superlink.routers.fleet.router import get_enable_supernode_auth

    return ((get_linkstate, get_runtime_state, get_runtime_handlers, get_protobuf_request,
             get_enable_supernode_auth), (VersionDependency,))


def run_flower_superlink(argv: list[str]) -> None:
    """Run the ``flower-superlink`` command with ``argv``. Relies on
    ``flwr.superlink.cli.flower_superlink.flower_superlink`` (Flower 1.41)."""
    import sys

    from flwr.superlink.cli.flower_superlink import flower_superlink

    sys.argv = ["flower-superlink", *argv]
    flower_superlink()


# The simulation engine --------------------------------------------------------------

def run_simulation(server_app: Any, client_app: Any, *, num_supernodes: int,
                   backend_name: str, backend_config: dict[str, Any]) -> None:
    """Run the apps on Flower's Simulation Runtime, as ``flwr-simulation`` does (the public
    ``flwr.simulation.run_simulation`` only adds a deprecation warning in front). Relies on
    ``flwr.simulation.run_simulation._run_simulation`` and
    ``flwr.supercore.telemetry.EventType`` (Flower 1.41)."""
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    _run_simulation(num_supernodes=num_supernodes, server_app=server_app,
                    client_app=client_app, backend_name=backend_name,
                    backend_config=backend_config,
                    exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE)


# Flower's own configuration (``flwr`` CLI) --------------------------------------------

def flwr_home() -> Path:
    """Flower's home folder (``$FLWR_HOME`` or the default). Relies on
    ``flwr.supercore.utils.get_flwr_home`` (Flower 1.41)."""
    from flwr.supercore.utils import get_flwr_home

    return Path(get_flwr_home())


def read_flower_config() -> dict[str, Any]:
    """Flower's ``config.toml`` as a dict. Relies on ``flwr.cli.flower_config`` (1.41)."""
    from flwr.cli.flower_config import read_flower_config as read

    config, _ = read()
    return config


def write_flower_config(config: dict[str, Any]) -> None:
    """Write Flower's ``config.toml``. Relies on ``flwr.cli.flower_config`` (Flower 1.41)."""
    from flwr.cli.flower_config import write_flower_config as write

    write(config)


def write_superlink_connection(name: str, address: str, *,
                               root_certificates: str | None) -> None:
    """Add ``[superlink.<name>]`` to Flower's config (insecure without certificates).
    Relies on ``flwr.cli.flower_config.write_superlink_connection`` and
    ``flwr.cli.typing.SuperLinkConnection`` (Flower 1.41)."""
    from flwr.cli.flower_config import write_superlink_connection as write
    from flwr.cli.typing import SuperLinkConnection

    if root_certificates is None:
        conn = SuperLinkConnection(name=name, address=address, insecure=True)
    else:
        conn = SuperLinkConnection(name=name, address=address,
                                   root_certificates=root_certificates)
    write(conn)


def register_node(federation: str, public_key_pem: bytes) -> int:
    """What ``flwr supernode register`` does: the new node id (0 if none was given).
    Relies on ``flwr.cli.flower_config.read_superlink_connection``,
    ``flwr.cli.utils.init_http_client_from_connection`` and
    ``flwr.proto.control_pb2.RegisterNodeRequest`` (Flower 1.41)."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import RegisterNodeRequest

    client = init_http_client_from_connection(read_superlink_connection(federation))
    try:
        res = client.RegisterNode(RegisterNodeRequest(public_key=public_key_pem))
    finally:
        client.close()
    return int(res.node_id)
