"""Grid I/O: push messages, pull their replies until all came, time is up or the caller stops.

Every round driver talks to Flower's Grid the same way: push the messages, then pull the
replies of the messages still pending, in push order, handing each over as it is pulled,
and sleep ``poll`` seconds after a pull that brought none. The in-process engine runs a
client only when its reply is pulled, in the order of the ids asked for, so that order is
the order the clients run in; its first pull answers every id, so it never sleeps.

In a deployment the SuperLink lists a reply before all its objects are there; the Grid's
retry of such an object starts at ``poll`` seconds (Flower: 1 s, doubling), so a pull
that catches a reply half pushed does not stall the round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Set

from flwr.app import Message
from flwr.serverapp import Grid

from client.protocol.flower_compat import OBJECT_RETRY_CAP_S, shorten_grid_object_retries


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

    Each pull asks for the pending ids in the order given; a pull that settled an id is
    followed by the next at once (the others' replies arrived while this one's objects
    were pulled, or soon), one that settled none by a sleep of ``poll`` seconds. It stops
    once no id is pending,
    ``timeout`` seconds have passed, or ``stop(pending ids)`` holds (checked after each
    pull). A reply to no pending id (a duplicate, a replay, a reply to another round) goes
    to ``on_stray`` when given, else it is ignored.
    """
    order = list(ids)
    pending = set(order)
    shorten_grid_object_retries(poll, max(poll, OBJECT_RETRY_CAP_S))
    deadline = time.monotonic() + timeout
    while pending:
        settled = False
        for reply in grid.pull_messages([i for i in order if i in pending]):
            msg_id = reply.metadata.reply_to_message_id
            if msg_id in pending:
                pending.discard(msg_id)
                on_reply(msg_id, reply)
                settled = True
            elif on_stray is not None:
                on_stray(reply)
            del reply  # not held while the next one is pulled (in-process: made)
        if not pending or time.monotonic() >= deadline or (stop is not None and stop(pending)):
            break
        if not settled:  # replies come together: after one, pull again at once
            time.sleep(poll)
    return [i for i in order if i in pending]


def push_and_collect_in_order(
        grid: Grid, messages: list[Message], *, timeout: float, poll: float,
        on_reply: Callable[[Message], None], pending_out: dict[str, int] | None = None,
        on_push: Callable[[dict[str, int]], None] | None = None) -> tuple[int, list[int]]:
    """Push messages and hand each reply to ``on_reply`` as soon as it can be consumed.

    Replies are consumed in push order (a reply that arrives early waits for the ones
    before it), so the aggregate does not depend on arrival order; on the in-process
    engine they arrive in that order and nothing waits. Each reply is dropped once
    consumed, so the server holds at most the out-of-order ones. Returns the number of
    replies and the destination node ids that did not answer before the deadline (their
    message ids go to ``pending_out`` when given, to pull the replies later).
    ``on_push`` gets {message id: destination node} once the messages are pushed. A reply
    to no pending message (a duplicate or a replay) goes to ``on_reply`` at once, to be
    rejected there, and does not count.
    """
    nodes_by_id = push(grid, messages)
    if on_push is not None:
        on_push(nodes_by_id)
    pushed = set(nodes_by_id.values())
    missing = [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in pushed]
    position = {msg_id: i for i, msg_id in enumerate(nodes_by_id)}
    waiting: dict[int, Message] = {}
    next_pos = 0

    def in_push_order(msg_id: str, reply: Message) -> None:
        nonlocal next_pos
        waiting[position[msg_id]] = reply
        while next_pos in waiting:
            on_reply(waiting.pop(next_pos))
            next_pos += 1

    # A reply to no pending message (a duplicate, or a reply to another round) is rejected.
    late = collect(grid, nodes_by_id, timeout=timeout, poll=poll, on_reply=in_push_order,
                   on_stray=on_reply)
    for pos in sorted(waiting):  # the deadline passed with gaps: consume the rest in order
        on_reply(waiting.pop(pos))
    if pending_out is not None:
        pending_out.update({i: nodes_by_id[i] for i in late})
    return len(nodes_by_id) - len(late), missing + [nodes_by_id[i] for i in late]
