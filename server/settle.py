"""Who answered: a reply counts only as the answer to a message sent to its node.

Every round that collects replies keeps ``{message id: (node, what it was sent)}`` of the
messages still awaiting a reply; :func:`settle` checks a reply against it, so a duplicate,
a replayed reply or one that claims another node is refused with its reason.

The SuperLink itself answers a message it cannot deliver, or whose reply it cannot hand
back, with an error reply of its own (sent from ``SUPERLINK_NODE_ID``): its node stopped
sending heartbeats, the message expired or went with its node, or the reply expired.
:func:`unreachable` tells that reply apart: the node is gone, a dropout, not a bad reply.
"""

from __future__ import annotations

from typing import TypeVar

from flwr.app import Message

from client.protocol.flower_compat import SUPERLINK_NODE_ID, ErrorCode

T = TypeVar("T")

#: The error codes of the SuperLink's own replies for a message that cannot be answered.
UNDELIVERABLE = frozenset({ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE,
                           ErrorCode.REPLY_MESSAGE_UNAVAILABLE})


def unreachable(reply: Message, node: int) -> str | None:
    """Why ``node`` cannot answer, when ``reply`` (to the message sent to ``node``) is the
    SuperLink's error reply for an undeliverable message; None for any other reply."""
    if not (reply.has_error() and reply.metadata.src_node_id == SUPERLINK_NODE_ID
            and reply.error.code in UNDELIVERABLE):
        return None
    lines = (reply.error.reason or "").strip().splitlines()
    return f"node {node} unreachable: {lines[0][:300] if lines else 'no reason given'}"


def settle(sent: dict[str, tuple[int, T]], reply: Message,
           fallback: T) -> tuple[str, T, str | None]:
    """The client ``reply`` answers for, what it was sent (``fallback`` when it answers
    no message awaiting a reply) and why it cannot be that client's answer (None when it
    can). The message it answers is taken out of ``sent``. The SuperLink's reply for an
    undeliverable message answers for its node: see :func:`unreachable`."""
    claimed, msg_id = reply.metadata.src_node_id, reply.metadata.reply_to_message_id
    entry = sent.pop(msg_id, None)
    if entry is None:
        return str(claimed), fallback, (
            f"reply to message {msg_id!r}, which awaits no reply (a duplicate or a replay)")
    node, what = entry
    if claimed != node and unreachable(reply, node) is None:
        return str(node), what, mismatch(node, claimed)
    return str(node), what, None


def mismatch(node: int, claimed: int) -> str:
    """The reason for a reply to the message sent to ``node`` that claims ``claimed``."""
    return f"reply to the message sent to node {node} says it comes from node {claimed}"
