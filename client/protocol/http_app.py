"""Flower's HTTP apps (the SuperLink's and the SuperNode's) with less CPU per request.

Flower 1.41 serves its Fleet, Runtime and Control APIs through FastAPI apps whose
Starlette ``BaseHTTPMiddleware`` layers (error translation, protobuf translation, node
authentication, tracing, event logs, licence checks) each run the rest of the stack in
their own anyio task group and stream the response through their own wrapper, even
where a layer's ``dispatch`` only passes the request on; FastAPI then runs every
synchronous dependency of a route in a worker thread. On a small machine that machinery,
not the state behind it, is most of a request's CPU time. This module runs the same
layers as one (``merge_middleware``) and the dependencies that only read the request or
the app's state on the event loop (``run_dependencies_inline``): every check,
translation and log runs as before, in Flower's order.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from client.protocol.flower_compat import trivial_http_dependencies


def _check_layer(layer: Middleware) -> None:
    """Raise RuntimeError unless ``layer`` is a plain ``BaseHTTPMiddleware`` (its work in
    ``dispatch``), the only kind ``MergedHTTPMiddleware`` can run."""
    cls = layer.cls
    if not (isinstance(cls, type) and issubclass(cls, BaseHTTPMiddleware)
            and cls.__call__ is BaseHTTPMiddleware.__call__):
        raise RuntimeError(f"Middleware {layer!r} is not a plain BaseHTTPMiddleware; "
                           "fedring's HTTP wrappers do not support this Flower version")


class MergedHTTPMiddleware(BaseHTTPMiddleware):
    """Several ``BaseHTTPMiddleware`` layers run as one: each layer's ``dispatch`` in
    order, outermost first, each given the next as its ``call_next``. What the layers
    see is what they see stacked (the request, its state, the response and any
    exception from inside); the request passes through one task group and one response
    stream instead of one per layer."""

    def __init__(self, app: ASGIApp, layers: Sequence[Middleware]) -> None:
        super().__init__(app)
        for layer in layers:
            _check_layer(layer)
        # each layer made as Starlette makes it, its own app never called
        self._dispatches = tuple(layer.cls(app, *layer.args, **layer.kwargs).dispatch_func
                                 for layer in layers)

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await self._layer(0, request, call_next=call_next)

    async def _layer(self, i: int, request: Request, *,
                     call_next: RequestResponseEndpoint) -> Response:
        if i == len(self._dispatches):
            return await call_next(request)
        return await self._dispatches[i](request,
                                         functools.partial(self._layer, i + 1,
                                                           call_next=call_next))


def merge_middleware(middleware: list[Middleware]) -> list[Middleware]:
    """Flower's middleware list as one ``MergedHTTPMiddleware`` entry. Raises RuntimeError
    (when the SuperLink builds its app, before it serves) if an entry is not a plain
    ``BaseHTTPMiddleware``."""
    for layer in middleware:
        _check_layer(layer)
    return [Middleware(MergedHTTPMiddleware, layers=tuple(middleware))]


def run_dependencies_inline(inline: Callable[[Any], bool]) -> None:
    """Make FastAPI call a synchronous dependency for which ``inline(call)`` holds on the
    event loop instead of in a worker thread.

    Relies on ``fastapi.dependencies.utils.solve_dependencies`` calling the module-level
    ``run_in_threadpool(call, **values)`` for a synchronous dependency (FastAPI 0.138)."""
    from fastapi.dependencies import utils

    current = getattr(utils, "run_in_threadpool", None)
    if current is None or "run_in_threadpool" not in utils.solve_dependencies.__code__.co_names:
        raise RuntimeError("fastapi.dependencies.utils no longer runs dependencies with "
                           "run_in_threadpool; fedring's HTTP wrappers do not support this "
                           "FastAPI version")
    threadpool = getattr(current, "__wrapped__", current)  # once patched: the original

    @functools.wraps(threadpool)
    async def run(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if inline(func):
            return func(*args, **kwargs)
        return await threadpool(func, *args, **kwargs)

    utils.run_in_threadpool = run  # type: ignore[attr-defined]


def is_trivial_dependency(func: Any) -> bool:
    """Whether ``func`` is one of the dependencies that only read the request
    or the app's state (``trivial_http_dependencies``)."""
    functions, classes = _trivial()
    return isinstance(func, classes) or any(func is f for f in functions)


def check_trivial_dependencies() -> None:
    """Raise ImportError now, not at the first request, when a name the dependency list
    relies on is gone from Flower."""
    _trivial()


@functools.cache
def _trivial() -> tuple[tuple[Callable[..., Any], ...], tuple[type, ...]]:
    return trivial_http_dependencies()


def add_http_options(parser: argparse.ArgumentParser, api: str) -> None:
    """The wrappers' options that keep Flower's way for ``api``'s app."""
    parser.add_argument("--stacked-middleware", action="store_true",
                        help=f"run {api}'s middleware layers stacked, as Flower does")
    parser.add_argument("--threaded-dependencies", action="store_true",
                        help="run every synchronous dependency in a worker thread, as "
                             "FastAPI does")


def inline_trivial_dependencies() -> None:
    """Call the trivial dependencies on the event loop; fails now, not at the first
    request, when a name they rely on is gone."""
    check_trivial_dependencies()
    run_dependencies_inline(is_trivial_dependency)
