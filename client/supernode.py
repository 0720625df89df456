"""Flower's ``flower-supernode`` with its hard-coded idle waits made configurable.

Flower 1.41's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps 3 s
after every pull from the SuperLink that found no message, and waits for the ClientApp's
reply in 0.5 s steps. On a fast link most of a round is spent in those sleeps. This
wrapper runs the unmodified ``flower-supernode`` command with the loop's ``time.sleep``
replaced: the 3 s idle sleep becomes ``--pull-interval`` (a request to the SuperLink per
interval while idle), or ``--busy-pull-interval`` for ``--busy-window`` seconds after the
node last waited for a reply (the next message of a multi-stage round, such as secure
aggregation's, comes soon; the wait grows with the time since the reply,
``--busy-pull-growth``), and the 0.5 s steps become ``--reply-interval`` (a look at
local state only); a message object not yet on the SuperLink is retried after 5 reply
intervals instead of 1 s, at most every ``OBJECT_RETRY_CAP_S``. With ``--task-signal
NAME`` the node wakes its warm executor (``client.executor --task-signal NAME``) once a
message and all its objects are stored, so the executor need not poll for tasks
(``client.task_signal``). The node's Runtime API, where its executor connects, runs
Flower's middleware as one layer and its trivial dependencies on the event loop, as the
SuperLink wrapper does (``client.protocol.http_app``; ``--stacked-middleware`` and
``--threaded-dependencies`` keep Flower's way), and leaves a task's FAB out of its input
when the executor already holds it (``client.held_fab``). Every other argument goes to
``flower-supernode`` unchanged::

    python -m client.supernode --pull-interval 0.2 -- --superlink 10.0.0.1:9093 ...
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware

from client.held_fab import SkipHeldFab, note_held_fab
from client.protocol.flower_compat import (
    FLOWER_IDLE_SLEEP_S,
    FLOWER_REPLY_SLEEP_S,
    OBJECT_RETRY_CAP_S,
    customize_supernode_app,
    on_supernode_message,
    run_flower_supernode,
    shorten_supernode_waits,
)
from client.protocol.http_app import (
    add_http_options,
    inline_trivial_dependencies,
    merge_middleware,
)
from client.task_signal import notifier

#: Within the busy window, an idle wait is at least this fraction of the time since the
#: last reply wait: every 0.05 s for 0.4 s after it, then less often, up to the idle
#: interval (27 pulls in a 3 s window with the defaults, against 60).
BUSY_PULL_GROWTH = 0.125


def make_sleep(pull_s: float, reply_s: float,
               sleep: Callable[[float], None] = time.sleep, *,
               busy_pull_s: float | None = None, busy_window_s: float = 0.0,
               busy_growth: float = 0.0,
               clock: Callable[[], float] = time.monotonic) -> Callable[[float], None]:
    """A ``time.sleep`` that maps Flower's idle wait to ``pull_s`` and its reply waits to
    ``reply_s`` (any other duration is kept). Within ``busy_window_s`` seconds of the last
    reply wait the idle wait is ``busy_pull_s``, or ``busy_growth`` times the time since
    that reply wait when longer (at most ``pull_s``): a message that comes ``t`` seconds
    after the reply is found at most ``busy_growth * t`` late, with far fewer requests
    to the SuperLink than a fixed ``busy_pull_s``."""
    last_reply_wait = -float("inf")

    def patched(seconds: float) -> None:
        nonlocal last_reply_wait
        if seconds == FLOWER_IDLE_SLEEP_S:
            since = clock() - last_reply_wait
            if busy_pull_s is not None and since < busy_window_s:
                seconds = min(pull_s, max(busy_pull_s, busy_growth * since))
            else:
                seconds = pull_s
        elif seconds == FLOWER_REPLY_SLEEP_S:
            last_reply_wait = clock()
            seconds = reply_s
        sleep(seconds)

    return patched


def shorten_waits(pull_s: float, reply_s: float, *, busy_pull_s: float | None = None,
                  busy_window_s: float = 0.0, busy_growth: float = 0.0) -> None:
    """Give the SuperNode loop a sleep that is shortened (``make_sleep``)."""
    # A message can be pulled before all its objects are on the SuperLink; Flower retries
    # an object after 1 s, doubling up to 10 s. Retry after 5 reply intervals instead.
    initial = reply_s * 5
    shorten_supernode_waits(make_sleep(pull_s, reply_s, busy_pull_s=busy_pull_s,
                                       busy_window_s=busy_window_s, busy_growth=busy_growth),
                            initial_backoff=initial,
                            backoff_cap=max(initial, OBJECT_RETRY_CAP_S))


def customize_runtime_api(app: Any, *, stacked: bool = False) -> None:
    """The node's Runtime API app: Flower's middleware run as one layer (unless
    ``stacked``), with ``note_held_fab`` innermost, and a task's FAB left out of its input
    when the executor holds it (``client.held_fab``)."""
    layers = [*app.user_middleware, Middleware(BaseHTTPMiddleware, dispatch=note_held_fab)]
    app.user_middleware[:] = layers if stacked else merge_middleware(layers)
    app.state.runtime_handlers = SkipHeldFab(app.state.runtime_handlers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m client.supernode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pull-interval", type=float, default=0.2,
                        help="seconds between pulls from the SuperLink while idle "
                             f"(Flower: {FLOWER_IDLE_SLEEP_S:g})")
    parser.add_argument("--reply-interval", type=float, default=0.01,
                        help="seconds between looks for the ClientApp's reply "
                             f"(Flower: {FLOWER_REPLY_SLEEP_S:g})")
    parser.add_argument("--busy-pull-interval", type=float, default=0.05,
                        help="seconds between pulls within --busy-window of a reply")
    parser.add_argument("--busy-window", type=float, default=3.0,
                        help="seconds after a reply during which the node pulls every "
                             "--busy-pull-interval (0: always --pull-interval)")
    parser.add_argument("--busy-pull-growth", type=float, default=BUSY_PULL_GROWTH,
                        help="within --busy-window, wait at least this fraction of the "
                             "time since the reply (0: always --busy-pull-interval; "
                             f"default {BUSY_PULL_GROWTH:g})")
    parser.add_argument("--task-signal", metavar="NAME",
                        help="wake the executor listening on this socket name once a "
                             "message is stored (client.executor --task-signal)")
    add_http_options(parser, "the Runtime API")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if min(args.pull_interval, args.reply_interval, args.busy_pull_interval) <= 0:
        parser.error("--pull-interval, --busy-pull-interval and --reply-interval must be > 0")
    if args.busy_window < 0:
        parser.error("--busy-window must be >= 0")
    if not 0 <= args.busy_pull_growth < 1:
        parser.error("--busy-pull-growth must be in [0, 1)")
    shorten_waits(args.pull_interval, args.reply_interval,
                  busy_pull_s=args.busy_pull_interval, busy_window_s=args.busy_window,
                  busy_growth=args.busy_pull_growth)
    customize_supernode_app(functools.partial(customize_runtime_api,
                                              stacked=args.stacked_middleware))
    if not args.threaded_dependencies:
        inline_trivial_dependencies()
    if args.task_signal:
        on_supernode_message(notifier(args.task_signal))
    run_flower_supernode(rest[1:] if rest[:1] == ["--"] else rest,
                         colored=sys.stderr.isatty())


if __name__ == "__main__":
    main()
