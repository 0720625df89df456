"""server.grid_io: push, then pull the replies of the pending messages until done.

The Grid is the in-process engine (real messages, a ClientApp run as its reply is
pulled) with a script of which pull first returns each node's reply, and of replies
to hand out again; time is a fake clock that moves only when the helper sleeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import pytest
from flwr.app import Message, RecordDict

import server.grid_io
from server.grid_io import collect, push
from simulations.inprocess import InProcessGrid

NEVER = 0  # a node whose reply never comes


class ScriptedGrid(InProcessGrid):
    """In-process nodes; node ``n``'s reply comes first with pull ``arrives.get(n, 1)``.

    ``extra``: replies a pull yields first (by pull number); ``replay``: every pull yields
    again the replies earlier pulls delivered (duplicates) before the new ones.
    """

    def __init__(self, num_nodes: int, *, arrives: dict[int, int] | None = None,
                 replay: bool = False) -> None:
        super().__init__(self._answer, num_nodes)
        self.arrives = arrives or {}
        self.replay = replay
        self.log: list[str] = []  # "run N" as node N's client runs, "reply N" as it is taken
        self.pulls: list[list[str]] = []  # the ids each pull asked for
        self.extra: dict[int, list[Message]] = {}
        self.delivered: list[Message] = []

    def _answer(self, msg: Message, context) -> Message:
        self.log.append(f"run {context.node_id}")
        return Message(RecordDict(), reply_to=msg)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        ids = list(message_ids)
        self.pulls.append(ids)
        n = len(self.pulls)
        yield from self.extra.pop(n, [])
        if self.replay:
            yield from list(self.delivered)
        due = [i for i in ids if i in self._queue
               and 0 < self.arrives.get(self._queue[i].metadata.dst_node_id, 1) <= n]
        for reply in super().pull_messages(due):
            self.delivered.append(reply)
            yield reply


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: ``monotonic`` moves only by what ``sleep`` is asked to wait."""
    fake = SimpleNamespace(now=0.0, sleeps=[])

    def sleep(seconds: float) -> None:
        assert len(fake.sleeps) < 100, "still waiting long after every deadline here"
        fake.sleeps.append(seconds)
        fake.now += seconds

    monkeypatch.setattr(server.grid_io, "time",
                        SimpleNamespace(monotonic=lambda: fake.now, sleep=sleep))
    return fake


def send(grid: ScriptedGrid, nodes: list[int]) -> dict[str, int]:
    return push(grid, [Message(RecordDict(), node, "train", group_id="1") for node in nodes])


def test_push_maps_each_taken_message_to_its_node_in_push_order():
    grid = ScriptedGrid(3)
    sent = send(grid, [3, 99, 1])  # node 99 does not exist: the Grid refuses that message
    assert list(sent.values()) == [3, 1]
    assert all(grid._queue[msg_id].metadata.dst_node_id == node for msg_id, node in sent.items())


def test_replies_are_pulled_in_the_order_given_and_handed_over_as_pulled(clock):
    grid = ScriptedGrid(4)
    sent = send(grid, [3, 1, 4, 2])

    def take(msg_id: str, reply: Message) -> None:
        assert reply.metadata.reply_to_message_id == msg_id
        grid.log.append(f"reply {sent[msg_id]}")

    left = collect(grid, sent, timeout=10.0, poll=1.0, on_reply=take)
    assert left == []
    # each client runs only when its reply is pulled, and is handed over before the next
    assert grid.log == ["run 3", "reply 3", "run 1", "reply 1", "run 4", "reply 4",
                        "run 2", "reply 2"]
    assert grid.pulls == [list(sent)] and clock.sleeps == []  # all came: no wait


def test_later_pulls_ask_only_for_the_pending_ids_and_sleep_only_after_an_empty_one(clock):
    grid = ScriptedGrid(4, arrives={1: 4, 2: 2, 4: 4})
    sent = send(grid, [1, 2, 3, 4])
    ids = list(sent)
    taken: list[int] = []
    left = collect(grid, ids, timeout=10.0, poll=0.5,
                   on_reply=lambda msg_id, reply: taken.append(sent[msg_id]))
    assert left == [] and taken == [3, 2, 1, 4]
    pending = [ids[0], ids[3]]
    assert grid.pulls == [ids, [ids[0], ids[1], ids[3]], pending, pending]
    assert clock.sleeps == [0.5]  # pulls 1 and 2 each settled one: the next came at once


def test_the_deadline_ends_the_wait_and_the_silent_ids_come_back_in_order(clock):
    grid = ScriptedGrid(4, arrives={2: NEVER, 3: 2, 4: NEVER})
    sent = send(grid, [4, 3, 2, 1])
    ids = list(sent)
    taken: list[int] = []
    left = collect(grid, ids, timeout=1.0, poll=0.25,
                   on_reply=lambda msg_id, reply: taken.append(sent[msg_id]))
    assert left == [ids[0], ids[2]] and taken == [1, 3]
    # two pulls that settled one each, then empty pulls at 0, .25, ..., 1.0
    assert len(grid.pulls) == 7 and clock.sleeps == [0.25] * 4
    assert collect(grid, ids[:1], timeout=0.0, poll=0.25,
                   on_reply=lambda *_: None) == ids[:1]  # no time: one pull, no sleep
    assert len(grid.pulls) == 8 and len(clock.sleeps) == 4


def test_the_callers_stop_condition_ends_the_wait_after_a_pull(clock):
    grid = ScriptedGrid(3, arrives={1: 3, 3: NEVER})
    sent = send(grid, [1, 2, 3])
    ids = list(sent)
    seen: list[set[str]] = []

    def only_node_3_left(pending) -> bool:
        seen.append(set(pending))
        return {sent[i] for i in pending} == {3}

    left = collect(grid, ids, timeout=100.0, poll=1.0, on_reply=lambda *_: None,
                   stop=only_node_3_left)
    assert left == [ids[2]]
    assert seen == [{ids[0], ids[2]}, {ids[0], ids[2]}, {ids[2]}] and clock.sleeps == [1.0]


@pytest.mark.parametrize("with_on_stray", [True, False])
def test_a_reply_to_no_pending_message_is_a_stray_and_settles_nothing(clock, with_on_stray):
    grid = ScriptedGrid(3, arrives={2: 2}, replay=True)
    (other,) = InProcessGrid.pull_messages(grid, list(send(grid, [3])))  # an earlier round's
    grid.extra = {2: [other]}
    sent = send(grid, [1, 2])
    ids = list(sent)
    taken: list[str] = []
    strays: list[Message] = []
    left = collect(grid, ids, timeout=10.0, poll=1.0,
                   on_reply=lambda msg_id, reply: taken.append(msg_id),
                   on_stray=strays.append if with_on_stray else None)
    assert left == [] and taken == ids  # each settled once, by its own reply
    first = grid.delivered[0]
    assert first.metadata.reply_to_message_id == ids[0]
    # pull 2: the other round's reply, then node 1's reply again (a duplicate)
    assert strays == ([other, first] if with_on_stray else [])
    assert len(grid.pulls) == 2 and clock.sleeps == []  # pull 1 settled node 1's: no wait
