"""The in-process engine's node contexts: made when a node is first asked for, kept in a
bounded cache that spills node state to disk.

A node's ``Context`` carries its node config (made again from the node id when needed)
and its ``state``: a RecordDict where stateful clients keep what lives from round to
round (FedBN's local entries, client momentum, DP-SGD accountants, error feedback,
secure-aggregation leftovers). :class:`NodeContexts` makes a context the first time its
node is asked for and keeps at most ``capacity`` of them in memory, least recently used
first out. An evicted context whose state is empty is simply dropped (a new one is the
same); any other's state is pickled into a SQLite file in a temporary folder of the run
and restored, byte for byte, the next time the node is asked for. Nodes in use by a pull
(``pinned``) are never evicted, so a context handed to a cohort hook is the one its
message is delivered with.
"""

from __future__ import annotations

import pickle
import shutil
import sqlite3
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from flwr.app import Context, RecordDict


class SpillStore:
    """Node states on disk: ``node id -> pickled RecordDict`` in a SQLite file of its own
    temporary folder (removed when the store is closed or collected)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="fedring-nodes-")
        self._db = sqlite3.connect(f"{self._dir}/states.sqlite", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE states (node INTEGER PRIMARY KEY, state BLOB NOT NULL)")
        self._close = weakref.finalize(self, _remove, self._db, self._dir)
        self.spilled = 0  # states written so far
        self.restored = 0  # states read back so far

    def put(self, node: int, state: RecordDict) -> None:
        self._db.execute("INSERT OR REPLACE INTO states VALUES (?, ?)",
                         (node, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)))
        self.spilled += 1

    def take(self, node: int) -> RecordDict | None:
        """``node``'s spilled state, removed from disk (None: none was spilled)."""
        row = self._db.execute("SELECT state FROM states WHERE node = ?", (node,)).fetchone()
        if row is None:
            return None
        self._db.execute("DELETE FROM states WHERE node = ?", (node,))
        self.restored += 1
        state = pickle.loads(row[0])
        assert isinstance(state, RecordDict)
        return state

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM states").fetchone()[0])

    def close(self) -> None:
        self._close()


def _remove(db: sqlite3.Connection, folder: str) -> None:
    db.close()
    shutil.rmtree(folder, ignore_errors=True)


class NodeContexts(Mapping[int, Context]):
    """Contexts of nodes ``1..num_nodes``, made by ``make(node_id)`` on first use, at most
    ``capacity`` in memory (None: no bound); the others' non-empty states on disk."""

    def __init__(self, num_nodes: int, make: Callable[[int], Context],
                 capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"engine.node_cache must be >= 1 (nodes kept in memory) or 0 "
                             f"for no bound, got {capacity}")
        self._nodes = range(1, num_nodes + 1)
        self._make = make
        self.capacity = capacity
        self._live: OrderedDict[int, Context] = OrderedDict()
        self._pinned: dict[int, int] = {}  # node -> pulls using it
        self._spill: SpillStore | None = None
        self._lock = threading.RLock()

    def __getitem__(self, node: int) -> Context:
        if node not in self._nodes:
            raise KeyError(node)
        with self._lock:
            context = self._live.get(node)
            if context is not None:
                self._live.move_to_end(node)
                return context
            context = self._make(node)
            state = self._spill.take(node) if self._spill is not None else None
            if state is not None:
                context.state = state
            self._live[node] = context
            self._evict()
            return context

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __iter__(self) -> Iterator[int]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def nodes(self) -> range:
        """The node ids, ascending."""
        return self._nodes

    @property
    def in_memory(self) -> int:
        """How many contexts are held in memory now."""
        return len(self._live)

    @property
    def spill(self) -> SpillStore | None:
        """The on-disk store of evicted states (None until a non-empty one was evicted)."""
        return self._spill

    @contextmanager
    def pinned(self, nodes: Iterable[int]) -> Iterator[None]:
        """Keep ``nodes``' contexts in memory (once made) while the block runs."""
        held = list(nodes)
        with self._lock:
            for node in held:
                self._pinned[node] = self._pinned.get(node, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for node in held:
                    left = self._pinned[node] - 1
                    if left:
                        self._pinned[node] = left
                    else:
                        del self._pinned[node]
                self._evict()

    def _evict(self) -> None:
        """Move least recently used, unpinned contexts out until at most ``capacity`` stay."""
        if self.capacity is None:
            return
        excess = len(self._live) - self.capacity
        if excess <= 0:
            return
        victims = []
        for node in self._live:  # oldest first; pinned ones are the newest
            if len(victims) == excess:
                break
            if node not in self._pinned:
                victims.append(node)
        for node in victims:
            context = self._live.pop(node)
            if len(context.state):  # an empty state is the same as a new one: not stored
                if self._spill is None:
                    self._spill = SpillStore()
                self._spill.put(node, context.state)

    def close(self) -> None:
        """Drop the spilled states (the temporary folder goes with them)."""
        if self._spill is not None:
            self._spill.close()
