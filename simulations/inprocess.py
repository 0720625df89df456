"""The in-process engine: a Flower Grid that hands each message straight to the ClientApp.

No SuperLink, no Ray, no polling and no serialisation: ``push_messages`` queues, and
``pull_messages`` runs each queued ClientApp call as the caller iterates, so the
ServerApp sees replies one by one as they are produced. Node ids are 1..N and node
``i`` holds partition ``i - 1``, like Flower's simulation engine's node config; the node
config also says "fedring.in-process", so fedring's ClientApp hands its delta over in a
reused buffer instead of fresh bytes, and gives ``mask-threads``: the cores this process
may use, which a secure client masks with since it runs alone (one thread each where
nodes run at once).

Nodes and their contexts are made when a node is first sent a message
(``simulations.node_states``): a population of millions costs memory only for the nodes
sampled, and at most ``node_cache`` contexts stay in memory, the others' node state
spilled to disk and restored exactly when the node is sampled again. With ``threads = "auto"``
each client trains on the intra-op threads ``simulations.client_threads`` picks for its
model's size.
"""

from __future__ import annotations

import itertools
import logging
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from client.protocol.flower_compat import (
    SUPERLINK_NODE_ID,
    Run,
    copy_record,
    empty_run,
    record_entries,
    set_message_id,
    set_sender,
    set_task_identity,
)
from client.protocol.keys import NodeConfigKey
from privacy.secagg.workers import default_threads
from simulations.client_threads import client_threads, intra_op_threads
from simulations.module_task import TaskCodeError
from simulations.node_states import NodeContexts
from simulations.secagg_pki import SimulatedPKI

CLIENT_ERROR = 1  # Error code carried by replies of a ClientApp that raised
CohortHook = Callable[[list[tuple[Message, Context]]], None]


def _private_records(content: RecordDict) -> RecordDict:
    """The message's own copy of its small records; the arrays are shared, read-only.

    A server may send one content object to every node; a ClientApp or mod that edits
    its ConfigRecord (Flower's secaggplus_mod pops keys) must not change what the next
    node receives, as it could not over a network. The records were checked when the
    server made them, so the copy takes their entries as they are instead of checking
    each one again (which cost more than the rest of a message's delivery).
    """
    copy = RecordDict()
    entries = record_entries(copy)
    if entries is None:  # not the TypedDict layout this was written for: copy the slow way
        return RecordDict({key: value if isinstance(value, ArrayRecord)
                           else type(value)(dict(value)) for key, value in content.items()})
    for key, value in content.items():
        entries[key] = value if isinstance(value, ArrayRecord) else copy_record(value)
    return copy


class InProcessGrid(Grid):
    """A Grid over ``num_nodes`` ClientApp nodes living in this process."""

    #: Whether nodes work on their messages at the same time (then each masks on one thread).
    concurrent = False

    def __init__(self, client_app: ClientApp, num_nodes: int, *, run_id: int = 1,
                 run_config: dict[str, Any] | None = None,
                 mask_threads: int | None = None,
                 cohort_hook: CohortHook | None = None,
                 pki: SimulatedPKI | None = None,
                 node_cache: int | None = None, threads: int | str = 0) -> None:
        """``mask_threads``: the nodes' ``mask-threads`` (default: 1 if nodes run at once,
        else the cores this process may use). ``cohort_hook``: called with every
        (message, context) a pull is about to deliver, before the first is delivered, so
        that it can train them together (``client.vectorized``); it must not fail.
        ``pki``: a SecAgg+ identity per node in its node config (``simulations.secagg_pki``;
        default none). ``node_cache``: how many node contexts stay in memory, the others'
        state spilled to disk (None: all). ``threads``: ``engine.threads``, the intra-op
        threads each client trains on (``simulations.client_threads``; 0: as they are)."""
        if num_nodes < 1:
            raise ValueError(f"the in-process engine needs at least one node, got {num_nodes}")
        self._client_app = client_app
        self._cohort_hook = cohort_hook
        self._run = empty_run(run_id)
        if mask_threads is None:
            mask_threads = 1 if self.concurrent else default_threads()
        self._threads = threads
        self._sized: tuple[Any, int | None] = (None, None)  # (model record, its threads)
        node_config = {"num-partitions": num_nodes, NodeConfigKey.IN_PROCESS: True,
                       NodeConfigKey.MASK_THREADS: mask_threads}
        run_config = dict(run_config or {})

        def make_context(node_id: int) -> Context:
            return Context(run_id=run_id, node_id=node_id,
                           node_config={NodeConfigKey.PARTITION_ID: node_id - 1, **node_config,
                                        **(pki.node_config(node_id - 1) if pki else {})},
                           state=RecordDict(), run_config=dict(run_config))

        self._contexts = NodeContexts(num_nodes, make_context, node_cache)
        self._queue: dict[str, Message] = {}
        self._ids = itertools.count(1)
        # As Flower's runtimes do before running a ServerApp: messages read this identity.
        set_task_identity(run_id, run_id, SUPERLINK_NODE_ID)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The node ids ``1..N``: a ``range``, whatever N."""
        return self._contexts.nodes

    def close(self) -> None:
        """Drop the node states spilled to disk."""
        self._contexts.close()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self._contexts:
                continue  # an unknown node never answers, as on a real SuperLink
            msg_id = f"m{next(self._ids)}"
            msg.content = _private_records(msg.content)
            set_message_id(msg, msg_id)
            set_sender(msg, self._run.run_id, SUPERLINK_NODE_ID)
            self._queue[msg_id] = msg
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        """Run the ClientApp for each requested queued message, yielding its reply."""
        ids = [msg_id for msg_id in message_ids if msg_id in self._queue]
        # the nodes' contexts stay in memory while this pull delivers to them
        with self._contexts.pinned({self._queue[i].metadata.dst_node_id for i in ids}):
            if self._cohort_hook is not None and ids:
                self._cohort_hook([(self._queue[i],
                                    self._contexts[self._queue[i].metadata.dst_node_id])
                                   for i in ids])
            for msg_id in ids:
                msg = self._queue.pop(msg_id, None)
                if msg is not None:
                    # no local name for the reply: the next client trains while the caller
                    # may still hold it, and a reply nobody else holds has its buffer reused
                    yield self._deliver(msg_id, msg)

    def _deliver(self, msg_id: str, msg: Message) -> Message:
        context = self._contexts[msg.metadata.dst_node_id]
        try:
            threads = self._client_threads(msg.content)
            if threads is None:  # the process's setting, left as it is: no context to
                reply = self._client_app(msg, context)  # enter (15 us after a training)
            else:
                with intra_op_threads(threads):
                    reply = self._client_app(msg, context)
        except TaskCodeError as exc:  # the user's code: one line, its traceback in the log
            logging.getLogger("fedring").error("client %s: %s", context.node_id, exc,
                                               exc_info=exc)
            reply = Message(Error(CLIENT_ERROR, str(exc)), reply_to=msg)
        except Exception as exc:  # a failing client is a reply with an error, not a crash
            reply = Message(Error(CLIENT_ERROR, f"{type(exc).__name__}: {exc}\n"
                                                f"{traceback.format_exc(limit=3)}"),
                            reply_to=msg)
        set_message_id(reply, f"r{msg_id}")
        return reply

    def _client_threads(self, content: RecordDict) -> int | None:
        """``client_threads`` of a message's content, found once for the model record
        that every message of a round shares (the record kept: its id is not reused)."""
        entries = record_entries(content)
        arrays = (content if entries is None else entries).get("arrays")
        if arrays is not None and arrays is self._sized[0]:
            return self._sized[1]
        threads = client_threads(content, self._threads)
        self._sized = (arrays, threads)
        return threads

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))
