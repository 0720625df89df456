"""A ClientApp that raises, in the in-process engine: its reply is an error naming the
exception, whether the engine set its threads or left them as they were, and the other
clients of the pull still answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from simulations.client_threads import SMALL_MODEL
from simulations.inprocess import CLIENT_ERROR, InProcessGrid


@pytest.mark.parametrize("params", [610, SMALL_MODEL])  # threads set to 1; left as they are
def test_a_raising_client_gets_an_error_reply_and_the_others_answer(params):
    before = torch.get_num_threads()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if context.node_id == 2:
            raise RuntimeError("the client crashed")
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, 3, threads="auto")
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(params, np.float32))})})
    replies = grid.send_and_receive([grid.create_message(content, "train", n, "1")
                                     for n in (1, 2, 3)])
    assert [m.has_error() for m in replies] == [False, True, False]
    error = replies[1].error
    assert error.code == CLIENT_ERROR and "RuntimeError: the client crashed" in error.reason
    assert [m.metadata.src_node_id for m in replies] == [1, 2, 3]
    assert torch.get_num_threads() == before
