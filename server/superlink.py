"""Flower's ``flower-superlink`` with less CPU per HTTP request.

Flower 1.41's SuperLink serves every Fleet, Runtime and Control request through nine
Starlette ``BaseHTTPMiddleware`` layers (error translation, protobuf translation, node
authentication, event logs, Control authentication and licence checks); each layer
runs the rest of the stack in its own anyio task group and streams the response through
its own wrapper, even where its ``dispatch`` only passes the request on. FastAPI then
runs each synchronous dependency of the route (the protobuf request, the LinkState, the
version check) in a worker thread. On a small machine that machinery, not the LinkState,
is most of a request's CPU time. This wrapper runs the unmodified ``flower-superlink``
command with

- Flower's middleware run as one layer: the same ``dispatch`` functions, in Flower's
  order, composed inside one ``BaseHTTPMiddleware`` (``MergedHTTPMiddleware``), so every
  check, translation and log runs as before, with one task group per request;
- the dependencies that only read the request or the app's state
  (``superlink_trivial_dependencies``) called on the event loop; route handlers, the
  node-authentication check and every other dependency still run in worker threads.

TLS, SuperNode authentication, the access log and the log level are Flower's. Every
other argument goes to ``flower-superlink`` unchanged::

    python -m server.superlink -- --ssl-ca-certfile ca.pem ... --enable-supernode-auth
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from client.protocol.flower_compat import (
    replace_superlink_middleware,
    run_flower_superlink,
    superlink_trivial_dependencies,
)


def _check_layer(layer: Middleware) -> None:
    """Raise RuntimeError unless ``layer`` is a plain ``BaseHTTPMiddleware`` (its work in
    ``dispatch``), the only kind ``MergedHTTPMiddleware`` can run."""
    cls = layer.cls
    if not (isinstance(cls, type) and issubclass(cls, BaseHTTPMiddleware)
            and cls.__call__ is BaseHTTPMiddleware.__call__):
        raise RuntimeError(f"SuperLink middleware {layer!r} is not a plain BaseHTTPMiddleware; "
                           "this SuperLink wrapper does not support this Flower version")


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
                           "run_in_threadpool; this SuperLink wrapper does not support this "
                           "FastAPI version")
    threadpool = getattr(current, "__wrapped__", current)  # once patched: the original

    @functools.wraps(threadpool)
    async def run(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if inline(func):
            return func(*args, **kwargs)
        return await threadpool(func, *args, **kwargs)

    utils.run_in_threadpool = run  # type: ignore[attr-defined]


def is_trivial_dependency(func: Any) -> bool:
    """Whether ``func`` is one of the SuperLink's dependencies that only read the request
    or the app's state (``superlink_trivial_dependencies``)."""
    functions, classes = _trivial()
    return isinstance(func, classes) or any(func is f for f in functions)


@functools.cache
def _trivial() -> tuple[tuple[Callable[..., Any], ...], tuple[type, ...]]:
    return superlink_trivial_dependencies()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server.superlink", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacked-middleware", action="store_true",
                        help="run Flower's middleware layers stacked, as Flower does")
    parser.add_argument("--threaded-dependencies", action="store_true",
                        help="run every synchronous dependency in a worker thread, as "
                             "FastAPI does")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.stacked_middleware:
        replace_superlink_middleware(merge_middleware)
    if not args.threaded_dependencies:
        _trivial()  # fails now, not at the first request, when a name is gone
        run_dependencies_inline(is_trivial_dependency)
    run_flower_superlink(rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    main()
