"""Push messages to a Grid and pull their replies until all came, time is up or the caller stops.

Every round driver talks to Flower's Grid the same way: push the messages, then pull the
replies of the messages still pending, in push order, handing each over as it is pulled,
and sleep ``poll`` seconds between pulls. The in-process engine runs a client only when
its reply is pulled, in the order of the ids asked for, so that order is the order the
clients run in; its first pull answers every id, so it never sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Set

from flwr.app import Message
from flwr.serverapp import Grid


def push(grid: Grid, messages: list[Message]) -> dict[str, int]:
    """Push ``messages``; {message id: destination node} of those the Grid took, in push
    order (a message the Grid refused, e.g. to an unknown node, is left out)."""
    taken = {msg_id for msg_id in grid.push_messages(messages) if msg_id}
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages
            if m.metadata.message_id in taken}


def collect(grid: Grid, ids: Iterable[str], *, timeout: float, poll: float,
            on_reply: Callable[[str, Message], None],
            on_stray: Callable[[Message], None] | None = None,
            stop: Callable[[Set[str]], bool] | None = None) -> list[str]:
    """Pull the replies to ``ids`` and hand each to ``on_reply(message id, reply)`` as it is
    pulled; return the ids still without a reply, in the order given.

    Each pull asks for the pending ids in the order given. It stops once no id is pending,
    ``timeout`` seconds have passed, or ``stop(pending ids)`` holds (checked after each
    pull). A reply to no pending id (a duplicate, a replay, a reply to another round) goes
    to ``on_stray`` when given, else it is ignored.
    """
    order = list(ids)
    pending = set(order)
    deadline = time.monotonic() + timeout
    while pending:
        for reply in grid.pull_messages([i for i in order if i in pending]):
            msg_id = reply.metadata.reply_to_message_id
            if msg_id not in pending:
                if on_stray is not None:
                    on_stray(reply)
                continue
            pending.discard(msg_id)
            on_reply(msg_id, reply)
        if not pending or time.monotonic() >= deadline or (stop is not None and stop(pending)):
            break
        time.sleep(poll)
    return [i for i in order if i in pending]
