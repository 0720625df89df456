"""Bytes on the wire: a Grid that counts the payload of what goes down and comes up.

"Down" is the payload of every message pushed (the model, once per client; the secure
rounds' protocol messages), "up" that of every reply pulled (a dense or compressed delta,
full weights, a masked vector, key and share messages). The payload is the data of every
array plus every ``bytes`` value of a config record (where the secure-aggregation
protocol messages travel); the small settings, strings and metrics are not counted.
Sync rounds, secure rounds and the async drivers record each round's (each applied
aggregate's) traffic with :meth:`ByteCountingGrid.since_last`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from client.protocol.flower_compat import Run


def payload_bytes(message: Message) -> int:
    """Bytes of the arrays and ``bytes`` config values a message carries (0 for an error
    reply)."""
    if not message.has_content():
        return 0
    total = 0
    for record in message.content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(array.data) for array in record.values())
        elif isinstance(record, ConfigRecord):
            total += sum(len(v) for v in record.values() if isinstance(v, bytes))
    return total


def _total_payload(messages: list[Message]) -> int:
    """The payload bytes of ``messages``, each content counted once per message that
    carries it but measured once (a round sends one content object to every client)."""
    measured: dict[int, int] = {}
    total = 0
    for message in messages:
        key = id(message.content) if message.has_content() else 0
        if key not in measured:
            measured[key] = payload_bytes(message)
        total += measured[key]
    return total


class ByteCountingGrid(Grid):
    """Wraps a Grid; ``up`` and ``down`` grow with every reply pulled and message pushed."""

    def __init__(self, grid: Grid) -> None:
        self.inner = grid
        self.up = 0
        self.down = 0
        self._mark = (0, 0)

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.down += _total_payload(messages)
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        for reply in self.inner.pull_messages(message_ids):  # lazily: replies stream
            self.up += payload_bytes(reply)
            yield reply
            del reply  # not held while the next one is made (in-process: the next client)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self.down += _total_payload(messages)
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.up += sum(payload_bytes(r) for r in replies)
        return replies

    def totals(self) -> dict[str, int]:
        """Bytes up and down since this grid was made."""
        return {"bytes_up": self.up, "bytes_down": self.down}

    def since_last(self) -> dict[str, float]:
        """Bytes up and down since the previous call (a round's traffic, as metrics)."""
        up, down = self.up - self._mark[0], self.down - self._mark[1]
        self._mark = (self.up, self.down)
        return {"bytes_up": float(up), "bytes_down": float(down)}
