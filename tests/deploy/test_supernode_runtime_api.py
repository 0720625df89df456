"""The SuperNode wrapper's Runtime API (``client.supernode``) on Flower's own SuperNode app,
served over real HTTP and called through Flower's Runtime API client: Flower's layers run
as one, and a task's FAB is left out of its input exactly when the warm executor
(``client.executor``) holds that FAB."""

from __future__ import annotations

import hashlib
import importlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from flwr.app import Context, RecordDict
from flwr.proto.runtime_pb2 import PullTaskInputRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supernode import main as supernode_main
from flwr.supernode.nodestate import NodeStateFactory

from client import executor
from client.held_fab import HeldFabHeader, held_app
from client.protocol import flower_compat as flower
from client.protocol.http_app import MergedHTTPMiddleware
from client.supernode import customize_runtime_api

RUN_ID, NODE_ID = 5, 7
CONTENT = b"fedring app package " * 4096
FAB = Fab(hashlib.sha256(CONTENT).hexdigest(), CONTENT, {})


class Node:
    """A SuperNode's state with one run and its FAB, and its Runtime API on a free port."""

    def __init__(self, *, stacked: bool) -> None:
        factory = NodeStateFactory(ObjectStoreFactory())
        self.state = factory.state()
        self.state.set_node_id(NODE_ID)
        run = Run.create_empty(RUN_ID)
        run.fab_hash = FAB.hash_str
        self.state.store_run(run)
        self.state.store_fab(FAB)
        self.state.set_run_series_context(run.series_id, Context(
            run_id=RUN_ID, node_id=NODE_ID, node_config={}, state=RecordDict(), run_config={}))
        self.app = supernode_main.create_app(state_factory=factory)
        customize_runtime_api(self.app, stacked=stacked)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, "the Runtime API did not start"
        self.address = f"127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def new_task_token(self) -> str:
        """A ClientApp task of the run, claimed as the executor claims it."""
        assert self.state.create_task(TaskType.CLIENT_APP, RUN_ID, FAB.hash_str) is not None
        control = flower.runtime_client(self.address, insecure=True, root_certificates=None,
                                        component="SuperExec")
        res = control.AcquireTask(flower.acquire_task_request())
        assert res.HasField("task") and res.token
        return res.token

    def pull_input(self, interceptors: tuple[Any, ...] = ()) -> Any:
        client = flower.runtime_client(self.address, insecure=True, root_certificates=None,
                                       component="flwr-clientapp",
                                       token=self.new_task_token(), interceptors=interceptors)
        return client.PullTaskInput(PullTaskInputRequest())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(params=[False, True], ids=["merged", "stacked"])
def node(request) -> Iterator[Node]:
    running = Node(stacked=request.param)
    yield running
    running.stop()


def test_a_held_fab_is_left_out_of_the_task_input_and_any_other_is_sent(node) -> None:
    whole = node.pull_input()
    assert (whole.fab.hash_str, whole.fab.content) == (FAB.hash_str, CONTENT)
    held = node.pull_input((HeldFabHeader(FAB.hash_str),))
    assert held.fab.hash_str == FAB.hash_str and held.fab.content == b""
    assert held.run.run_id == RUN_ID and held.context.node_id == NODE_ID
    other = node.pull_input((HeldFabHeader("0" * 64),))  # another FAB held: this one sent
    assert other.fab.content == CONTENT


def test_the_executor_names_its_fab_once_it_holds_one(node) -> None:
    warm = executor.WarmExecutor(node.address, insecure=True)
    client = warm._client("flwr-clientapp", node.new_task_token())
    assert client.PullTaskInput(PullTaskInputRequest()).fab.content == CONTENT  # none held
    warm._app, warm._fab_hash = object(), FAB.hash_str  # as after loading this FAB
    client = warm._client("flwr-clientapp", node.new_task_token())
    res = client.PullTaskInput(PullTaskInputRequest())
    assert res.fab.content == b""
    assert held_app(warm._app, warm._fab_hash, flower_fab(res)) is warm._app


def flower_fab(res: Any) -> Fab:
    return Fab(res.fab.hash_str, res.fab.content, dict(res.fab.verifications))


def test_a_fab_without_content_is_used_only_when_held() -> None:
    app = object()
    empty = Fab(FAB.hash_str, b"", {})
    assert held_app(app, FAB.hash_str, empty) is app
    assert held_app(app, FAB.hash_str, FAB) is app
    assert held_app(app, "1" * 64, FAB) is None  # another FAB: load it
    assert held_app(None, "", FAB) is None
    with pytest.raises(ValueError, match="without its content"):
        held_app(app, "1" * 64, empty)
    with pytest.raises(ValueError, match="without its content"):
        held_app(None, "", empty)


def test_the_runtime_api_runs_flowers_layers_as_one_then_the_held_fab_note() -> None:
    flowers = list(supernode_main.create_app().user_middleware)
    app = supernode_main.create_app()
    customize_runtime_api(app)
    [layer] = app.user_middleware
    assert layer.cls is MergedHTTPMiddleware
    inner = layer.kwargs["layers"]
    assert [(m.cls, m.kwargs) for m in inner[:-1]] == [(m.cls, m.kwargs) for m in flowers]
    assert inner[-1].kwargs["dispatch"].__name__ == "note_held_fab"
    stacked = supernode_main.create_app()
    customize_runtime_api(stacked, stacked=True)
    assert len(stacked.user_middleware) == len(flowers) + 1


def test_customizing_fails_at_start_without_flowers_create_app(monkeypatch) -> None:
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    monkeypatch.setattr(cli, "_start_supernode_http_api", lambda config, factory: None)
    with pytest.raises(RuntimeError, match="does not support this Flower version"):
        flower.customize_supernode_app(lambda app: None)


def test_customizing_wraps_the_app_flower_starts(monkeypatch) -> None:
    monkeypatch.setattr(supernode_main, "create_app", supernode_main.create_app)
    seen: list[Any] = []
    flower.customize_supernode_app(seen.append)
    flower.customize_supernode_app(seen.append)  # patched twice: one wrapper
    app = supernode_main.create_app()
    assert seen == [app]
