"""A warm executor's FAB is not sent again with every task.

Flower's Runtime API answers every ``PullTaskInput`` with the run's FAB (the app package,
about 1.5 MB for fedring), which a ClientApp process needs once per run. fedring's warm
executor (``client.executor``) keeps the app it loaded and names its FAB's hash in the
``HELD_FAB_HEADER`` of the pull, as a conditional request does; fedring's SuperNode
(``client.supernode``) then answers with the FAB's hash and verifications but without its
content when that hash is the run's. A request without the header, a hash of another FAB,
or Flower's own SuperNode still gets the whole FAB.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

HELD_FAB_HEADER = "fedring-held-fab"

_held: ContextVar[str] = ContextVar("fedring_held_fab", default="")


class HeldFabHeader:
    """A Runtime API client interceptor naming the FAB the executor holds."""

    def __init__(self, fab_hash: str) -> None:
        self.fab_hash = fab_hash

    def intercept(self, context: Any, call_next: Any) -> Any:
        context.request.headers[HELD_FAB_HEADER] = self.fab_hash
        return call_next(context)


async def note_held_fab(request: Request, call_next: Any) -> Response:
    """Middleware: the request's held-FAB hash, for the handlers it reaches."""
    token = _held.set(request.headers.get(HELD_FAB_HEADER, ""))
    try:
        return await call_next(request)
    finally:
        _held.reset(token)


class SkipHeldFab:
    """Runtime handlers that answer ``PullTaskInput`` without the FAB's content when the
    caller holds that FAB; every other handler is ``handlers``' own."""

    def __init__(self, handlers: Any) -> None:
        self._handlers = handlers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handlers, name)

    def pull_task_input(self, request: Any, state: Any, task: Any) -> Any:
        response = self._handlers.pull_task_input(request, state, task)
        held = _held.get()
        if held and response.fab.hash_str == held:
            response.fab.content = b""
        return response


def held_app(cached: Any, cached_hash: str, fab: Any) -> Any:
    """``cached`` when ``fab`` is the FAB of hash ``cached_hash`` (its content left out or
    not), else None; raises ValueError for a FAB sent without content that is not held."""
    if cached is not None and cached_hash and fab.hash_str == cached_hash:
        return cached
    if not fab.content:
        raise ValueError(f"the SuperNode sent FAB {fab.hash_str[:12]} without its content, "
                         "and this executor does not hold it")
    return None
