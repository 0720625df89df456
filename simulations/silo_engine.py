"""Cross-silo rounds on the in-process engine: every silo handles its message on its own thread.

A ring needs all its silos at once, so the in-process engine's one-message-at-a-time
delivery cannot run it. ``ConcurrentGrid`` starts each message's ClientApp call on a
thread as soon as it is pushed (a node still handles one message at a time) and
``pull_messages`` returns the replies that are ready, as a SuperLink would. The silo
ClientApp (``client.silo.app``) keeps a model per node, and each silo joins the round's
ring from its own process (``client.silo.ring``), so the ring is real.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from flwr.app import Message
from flwr.clientapp import ClientApp

from client.silo.app import SiloClient, make_silo_client_app
from simulations.inprocess import InProcessGrid


class ConcurrentGrid(InProcessGrid):
    """In-process nodes that work on their messages at the same time, one thread each."""

    concurrent = True

    def __init__(self, client_app: ClientApp, num_nodes: int, **kwargs: Any) -> None:
        super().__init__(client_app, num_nodes, **kwargs)
        self._node_locks = {node: threading.Lock() for node in self._contexts}
        self._replies: dict[str, Message] = {}
        self._done = threading.Condition()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        for msg_id in ids:
            msg = self._queue.pop(msg_id)
            threading.Thread(target=self._work, args=(msg_id, msg), daemon=True,
                             name=f"silo-{msg.metadata.dst_node_id}").start()
        return ids

    def _work(self, msg_id: str, msg: Message) -> None:
        with self._node_locks[msg.metadata.dst_node_id]:
            reply = self._deliver(msg_id, msg)
        with self._done:
            self._replies[msg_id] = reply
            self._done.notify_all()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        """The replies among ``message_ids`` that are ready (never waits)."""
        with self._done:
            ready = [self._replies.pop(i) for i in list(message_ids) if i in self._replies]
        yield from ready

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        with self._done:
            self._done.wait_for(lambda: all(i in self._replies for i in ids), timeout)
        return list(self.pull_messages(ids))


def silo_client_app(task_factory: Any, resolve_spec: Any) -> ClientApp:
    """The silo ClientApp for in-process silos (one process each, no DDP inside)."""
    return make_silo_client_app(SiloClient(task_factory, resolve_spec))
