"""Tasks in flight for the asynchronous drivers: models handed to clients, settled in time
order on either clock (see ``server.clock``). The FedBuff and FedAsync policy that uses
them is in ``server.fedbuff``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid

from server.clock import Clock
from server.grid_io import collect
from server.wire_bytes import payload_bytes


@dataclass
class Task:
    """One model sent to one client and not yet settled."""

    msg_id: str
    node: int
    base_version: int
    seq: int
    pushed_at: float  # wall-clock seconds (time.monotonic)
    end: float | None = None  # simulated time it settles; None on the wall clock
    fate: str = "reply"  # "reply", or (simulated) "lost" / "late" when no reply will count
    reason: str | None = None


@dataclass
class Event:
    """A task settled at ``time``: its reply, or None with the reason."""

    task: Task
    time: float
    reply: Message | None
    reason: str | None = None
    nbytes: int = 0  # payload bytes of the reply pulled (also when it does not count)


class InFlight:
    """Tasks handed to clients, settled in time order on either clock.

    On the simulated clock a task settles at its reply's simulated arrival, when its
    client goes offline (lost) or at the deadline (late, its client stays busy until it
    would have finished); the reply is pulled from the Grid then, so the in-process
    engine computes it lazily. On the wall clock replies are polled and a task without a
    reply within the deadline settles as late.
    """

    def __init__(self, grid: Grid, clock: Clock, *, deadline: float, wall_limit: float,
                 poll: float) -> None:
        self.grid = grid
        self.clock = clock
        self.deadline = deadline
        self.wall_limit = wall_limit
        self.poll = poll
        self.tasks: dict[str, Task] = {}
        self.busy: dict[int, float] = {}  # node -> simulated time its late task ends
        self._seq = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def nodes(self) -> set[int]:
        return {t.node for t in self.tasks.values()}

    def free(self, node: int) -> bool:
        """Not holding a task, and (simulated) not still busy with a late one."""
        return self.busy.get(node, -1.0) <= self.clock.now()

    def push(self, messages: list[Message], base_version: int) -> None:
        ids = list(self.grid.push_messages(messages))
        pushed = time.monotonic()
        for msg_id, msg in zip(ids, messages, strict=False):
            node = msg.metadata.dst_node_id
            self._seq += 1
            task = Task(msg_id, node, base_version, self._seq, pushed)
            out = self.clock.outcome(node)
            if out is not None:
                task.end = out.end
                if out.lost:
                    task.fate, task.reason = "lost", (
                        f"offline: client went offline {out.duration:.4g} s into its task "
                        "(simulated)")
                elif out.duration > self.deadline:
                    task.fate, task.end = "late", out.start + self.deadline
                    task.reason = (f"late: needs {out.duration:.4g} s, deadline "
                                   f"{self.deadline:g} s (simulated)")
                    self.busy[node] = out.end
            self.tasks[msg_id] = task

    def next_events(self) -> list[Event]:
        """The next settled tasks (all those of the earliest instant when simulated)."""
        if not self.tasks:
            return []
        if self.clock.simulated:
            return self._next_simulated()
        return self._next_wall()

    def _next_simulated(self) -> list[Event]:
        t = min(task.end for task in self.tasks.values() if task.end is not None)
        batch = sorted((task for task in self.tasks.values() if task.end == t),
                       key=lambda task: (task.node, task.seq))
        replies = self._pull([task.msg_id for task in batch])
        self.clock.advance_to(t)
        events = []
        for task in batch:
            del self.tasks[task.msg_id]
            reply = replies.get(task.msg_id)
            if task.fate != "reply":  # its reply, if any, is discarded
                events.append(Event(task, t, None, task.reason,
                                    payload_bytes(reply) if reply is not None else 0))
            elif reply is None:
                events.append(Event(task, t, None,
                                    f"late: no reply within {self.wall_limit:g} s"))
            else:
                events.append(Event(task, t, reply, nbytes=payload_bytes(reply)))
        return events

    def _pull(self, ids: list[str]) -> dict[str, Message]:
        got: dict[str, Message] = {}
        collect(self.grid, ids, timeout=self.wall_limit, poll=self.poll,
                on_reply=got.__setitem__)
        return got

    def _next_wall(self) -> list[Event]:
        while True:
            arrived = {r.metadata.reply_to_message_id: r
                       for r in self.grid.pull_messages(list(self.tasks))}
            now, mono = self.clock.now(), time.monotonic()
            events = []
            for task in sorted(self.tasks.values(), key=lambda task: task.seq):
                if task.msg_id in arrived:
                    reply = arrived[task.msg_id]
                    events.append(Event(task, now, reply, nbytes=payload_bytes(reply)))
                elif mono - task.pushed_at > self.deadline:
                    events.append(Event(task, now, None,
                                        f"late: no reply within {self.deadline:g} s"))
            for ev in events:
                del self.tasks[ev.task.msg_id]
            if events:
                return events
            time.sleep(self.poll)
