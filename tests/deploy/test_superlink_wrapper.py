"""The SuperLink wrapper (``python -m server.superlink``) on Flower's own SuperLink app,
in process: Flower's middleware run as one layer answers every kind of request exactly
as Flower's stacked layers do (node authentication accepted and refused, protobuf and
error translation, Control routes), the trivial dependencies run on the event loop and
the rest in worker threads, and each patch fails at start when its Flower or FastAPI
name is gone."""

from __future__ import annotations

import threading
from base64 import b64encode
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from fastapi import Depends, FastAPI
from fastapi.dependencies import utils as fastapi_utils
from flwr.common.constant import TIMESTAMP_HEADER
from flwr.proto.control_pb2 import ListRunsRequest
from flwr.proto.fleet_pb2 import (
    PullMessagesRequest,
    RegisterNodeFleetRequest,
    RegisterNodeFleetResponse,
)
from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
from flwr.supercore.date import now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message
from flwr.superlink import main as superlink_main
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.testclient import TestClient

from client.protocol import http_app
from client.protocol.flower_compat import (
    replace_superlink_middleware,
    trivial_http_dependencies,
)

PROTOBUF = {"content-type": "application/protobuf"}


@pytest.fixture
def flower_middleware(monkeypatch) -> Iterator[None]:
    """Undo the wrapper's patch of Flower's middleware after the test."""
    monkeypatch.setattr(superlink_main, "_get_middleware", superlink_main._get_middleware)
    yield


def _client(merged: bool) -> TestClient:
    if merged:
        replace_superlink_middleware(http_app.merge_middleware)
    return TestClient(superlink_main.create_app(), raise_server_exceptions=False)


def _signed(body: Any, key: ec.EllipticCurvePrivateKey, *, public: bytes | None = None,
            tamper: bool = False) -> dict[str, Any]:
    stamp = now().isoformat()
    signature = sign_message(key, stamp.encode("ascii"))
    if tamper:
        signature = bytes([signature[0] ^ 1]) + signature[1:]
    public = public or public_key_to_bytes(key.public_key())
    return {"content": body.SerializeToString(), "headers": {
        **PROTOBUF, FLEET_HTTP_PUBLIC_KEY_HEADER: b64encode(public).decode("ascii"),
        TIMESTAMP_HEADER: stamp, FLEET_HTTP_SIGNATURE_HEADER: b64encode(signature).decode()}}


def _requests() -> list[tuple[str, str, dict[str, Any]]]:
    key, other = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    own = public_key_to_bytes(key.public_key())
    register = RegisterNodeFleetRequest(public_key=own)
    return [
        ("GET", "/health", {}),
        ("POST", "/v1/control/list-runs",
         {"content": ListRunsRequest().SerializeToString(), "headers": PROTOBUF}),
        ("POST", "/v1/fleet/register-node", _signed(register, key)),  # node auth accepts
        ("POST", "/v1/fleet/register-node", _signed(register, key, tamper=True)),
        ("POST", "/v1/fleet/register-node",  # signed by another key than the request's
         _signed(register, other)),
        ("POST", "/v1/fleet/register-node",
         _signed(register, key, public=public_key_to_bytes(other.public_key()))),
        ("POST", "/v1/fleet/pull-messages",  # no identity headers
         {"content": PullMessagesRequest().SerializeToString(), "headers": PROTOBUF}),
        ("POST", "/v1/fleet/pull-messages", {"content": b"x", "headers":
                                             {"content-type": "text/plain"}}),
        ("POST", "/v1/fleet/pull-messages", {"content": b"\xff\xff", "headers": PROTOBUF}),
        ("POST", "/v1/runtime/get-nodes", {"content": b"", "headers": PROTOBUF}),
        ("POST", "/v1/nowhere", {"content": b"", "headers": PROTOBUF}),
    ]


def _answers(client: TestClient, requests: list[tuple[str, str, dict[str, Any]]]) -> list[Any]:
    answers = []
    for method, path, kwargs in requests:
        res = client.request(method, path, **kwargs)
        body = res.content
        if path == "/v1/control/list-runs":  # the answer holds the time it was made
            body = len(body)
        elif path == "/v1/fleet/register-node" and res.status_code == 200:
            body = RegisterNodeFleetResponse.FromString(body).node_id > 0  # a new node id
        answers.append((path, res.status_code, res.headers.get("content-type"),
                        res.headers.get("cache-control"), body))
    return answers


def test_merged_middleware_answers_as_flowers_stacked_layers(flower_middleware) -> None:
    requests = _requests()
    stacked, merged = _answers(_client(False), requests), _answers(_client(True), requests)
    assert merged == stacked
    statuses = [status for _, status, *_ in merged]
    assert statuses == [200, 200, 200, 401, 401, 401, 401, 415, 400, 401, 404]


def test_the_app_runs_one_middleware_layer_holding_flowers_in_order(flower_middleware) -> None:
    flower = superlink_main._get_middleware()
    replace_superlink_middleware(http_app.merge_middleware)
    [layer] = superlink_main.create_app().user_middleware
    assert layer.cls is http_app.MergedHTTPMiddleware
    assert [m.cls for m in layer.kwargs["layers"]] == [m.cls for m in flower]
    replace_superlink_middleware(http_app.merge_middleware)  # twice: still one layer
    assert len(superlink_main.create_app().user_middleware) == 1


def test_merging_refuses_a_layer_that_is_not_a_plain_base_http_middleware() -> None:
    with pytest.raises(RuntimeError, match="not a plain BaseHTTPMiddleware"):
        http_app.merge_middleware([Middleware(GZipMiddleware)])


def test_replacing_the_middleware_fails_without_flowers_get_middleware(monkeypatch) -> None:
    monkeypatch.delattr(superlink_main, "_get_middleware")
    with pytest.raises(RuntimeError, match="no longer builds its middleware"):
        replace_superlink_middleware(http_app.merge_middleware)


def test_trivial_dependencies_are_flowers_and_are_recognised() -> None:
    functions, classes = trivial_http_dependencies()
    assert len(functions) == 5 and all(callable(f) for f in functions)
    assert all(http_app.is_trivial_dependency(f) for f in functions)
    assert not http_app.is_trivial_dependency(len)
    [version] = classes
    assert http_app.is_trivial_dependency(object.__new__(version))


def test_inline_dependencies_run_on_the_loop_and_the_others_in_threads(monkeypatch) -> None:
    monkeypatch.setattr(fastapi_utils, "run_in_threadpool", fastapi_utils.run_in_threadpool)
    seen: dict[str, int] = {}

    def inline() -> None:
        seen["inline"] = threading.get_ident()

    def threaded() -> None:
        seen["threaded"] = threading.get_ident()

    async def loop() -> None:
        seen["loop"] = threading.get_ident()

    app = FastAPI()

    @app.get("/", dependencies=[Depends(inline), Depends(threaded), Depends(loop)])
    def endpoint() -> int:
        return 1

    http_app.run_dependencies_inline(lambda f: f is inline)
    http_app.run_dependencies_inline(lambda f: f is inline)  # patched twice: one wrapper
    assert TestClient(app).get("/").json() == 1
    assert seen["inline"] == seen["loop"] != seen["threaded"]


def test_inlining_fails_without_fastapis_threadpool_call(monkeypatch) -> None:
    monkeypatch.delattr(fastapi_utils, "run_in_threadpool")
    with pytest.raises(RuntimeError, match="no longer runs dependencies"):
        http_app.run_dependencies_inline(lambda f: False)
