"""The in-process engine picks a client's threads once for the model record every message
of a round shares, and again for each new record (a new round's, a model of another size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from simulations.client_threads import SMALL_MODEL
from simulations.inprocess import InProcessGrid


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_each_round_record_gets_its_own_threads(two_threads) -> None:
    seen: list[int] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(torch.get_num_threads())
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, 3, threads="auto")

    def round_of(params: int) -> list[int]:
        record = ArrayRecord({"w": Array(np.zeros(params, np.float32))})  # one per round
        seen.clear()
        replies = grid.send_and_receive([
            grid.create_message(RecordDict({"arrays": record}), "train", n, "1")
            for n in (1, 2, 3)])
        assert not any(m.has_error() for m in replies)
        return list(seen)

    assert round_of(610) == [1, 1, 1]  # a small model: one thread
    assert round_of(SMALL_MODEL) == [2, 2, 2]  # a large one: the process's setting
    assert round_of(610) == [1, 1, 1]
    no_model = grid.send_and_receive([grid.create_message(RecordDict(), "train", 1, "1")])
    assert not no_model[0].has_error() and seen[-1] == 2 and torch.get_num_threads() == 2
