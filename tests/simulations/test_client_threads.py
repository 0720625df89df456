"""engine.threads: the in-process engine trains small-model clients on one intra-op thread
under "auto" (a scenario's default), restores the process's setting after each, and leaves
it as it is under 0 (a grid built without the setting)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from simulations.client_threads import SMALL_MODEL, client_threads, intra_op_threads
from simulations.inprocess import InProcessGrid


def _content(params: int) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(params, np.float32))})})


def test_the_choice_by_model_size():
    assert client_threads(_content(610), "auto") == 1
    assert client_threads(_content(SMALL_MODEL - 1), "auto") == 1
    assert client_threads(_content(SMALL_MODEL), "auto") is None
    assert client_threads(RecordDict(), "auto") is None  # no model: as it is
    assert client_threads(_content(610), 0) is None
    assert client_threads(_content(10**7), 3) == 3


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_block_runs_on_its_threads_and_restores_the_setting(two_threads):
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), intra_op_threads(1):
        raise RuntimeError("a failing client")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(("setting", "params", "inside"),
                         [("auto", 610, 1), ("auto", SMALL_MODEL, 2), (0, 610, 2)])
def test_the_grid_trains_each_client_on_the_chosen_threads(two_threads, setting, params,
                                                          inside):
    seen: list[int] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(torch.get_num_threads())
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, 3, threads=setting)
    replies = grid.send_and_receive([grid.create_message(_content(params), "train", n, "1")
                                     for n in (1, 3)])
    assert [m.has_error() for m in replies] == [False, False]
    assert seen == [inside, inside] and torch.get_num_threads() == 2
