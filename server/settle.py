"""Who answered: a reply counts only as the answer to a message sent to its node.

Every round that collects replies keeps ``{message id: (node, what it was sent)}`` of the
messages still awaiting a reply; :func:`settle` checks a reply against it, so a duplicate,
a replayed reply or one that claims another node is refused with its reason.
"""

from __future__ import annotations

from typing import TypeVar

from flwr.app import Message

T = TypeVar("T")


def settle(sent: dict[str, tuple[int, T]], reply: Message,
           fallback: T) -> tuple[str, T, str | None]:
    """The client ``reply`` answers for, what it was sent (``fallback`` when it answers
    no message awaiting a reply) and why it cannot be that client's answer (None when it
    can). The message it answers is taken out of ``sent``."""
    claimed, msg_id = reply.metadata.src_node_id, reply.metadata.reply_to_message_id
    entry = sent.pop(msg_id, None)
    if entry is None:
        return str(claimed), fallback, (
            f"reply to message {msg_id!r}, which awaits no reply (a duplicate or a replay)")
    node, what = entry
    if claimed != node:
        return str(node), what, (f"reply to the message sent to node {node} says it "
                                 f"comes from node {claimed}")
    return str(node), what, None
