"""Flower's ``flower-supernode`` with its hard-coded idle waits made configurable.

Flower 1.41's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps 3 s
after every pull from the SuperLink that found no message, and waits for the ClientApp's
reply in 0.5 s steps. On a fast link most of a round is spent in those sleeps. This
wrapper runs the unmodified ``flower-supernode`` command with the loop's ``time.sleep``
replaced: the 3 s idle sleep becomes ``--pull-interval`` (a request to the SuperLink per
interval while idle) and the 0.5 s steps become ``--reply-interval`` (a look at local
state only); a message object not yet on the SuperLink is retried after 5 reply
intervals instead of 1 s. Every other argument goes to ``flower-supernode`` unchanged::

    python -m client.supernode --pull-interval 0.2 -- --superlink 10.0.0.1:9093 ...
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from client.protocol.flower_compat import (
    FLOWER_IDLE_SLEEP_S,
    FLOWER_REPLY_SLEEP_S,
    run_flower_supernode,
    shorten_supernode_waits,
)


def make_sleep(pull_s: float, reply_s: float,
               sleep: Callable[[float], None] = time.sleep) -> Callable[[float], None]:
    """A ``time.sleep`` that maps Flower's idle wait to ``pull_s`` and its reply waits
    to ``reply_s`` (any other duration is kept)."""

    def patched(seconds: float) -> None:
        if seconds == FLOWER_IDLE_SLEEP_S:
            seconds = pull_s
        elif seconds == FLOWER_REPLY_SLEEP_S:
            seconds = reply_s
        sleep(seconds)

    return patched


def shorten_waits(pull_s: float, reply_s: float) -> None:
    """Give the SuperNode loop a sleep that is shortened (``make_sleep``)."""
    # A message can be pulled before all its objects are on the SuperLink; Flower retries
    # an object after 1 s, doubling. Retry after the reply interval instead.
    shorten_supernode_waits(make_sleep(pull_s, reply_s), initial_backoff=reply_s * 5,
                            backoff_cap=1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m client.supernode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pull-interval", type=float, default=0.2,
                        help="seconds between pulls from the SuperLink while idle "
                             f"(Flower: {FLOWER_IDLE_SLEEP_S:g})")
    parser.add_argument("--reply-interval", type=float, default=0.01,
                        help="seconds between looks for the ClientApp's reply "
                             f"(Flower: {FLOWER_REPLY_SLEEP_S:g})")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.pull_interval <= 0 or args.reply_interval <= 0:
        parser.error("--pull-interval and --reply-interval must be > 0")
    shorten_waits(args.pull_interval, args.reply_interval)
    run_flower_supernode(rest[1:] if rest[:1] == ["--"] else rest,
                         colored=sys.stderr.isatty())


if __name__ == "__main__":
    main()
