"""Bytes down and up as the in-process engine counts them."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from client.protocol.npy import npy_array
from server.wire_bytes import ByteCountingGrid, payload_bytes
from simulations.inprocess import InProcessGrid


def _echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": ArrayRecord({"x": npy_array(np.ones(5, np.float32))})}),
                   reply_to=msg)


def test_a_content_sent_to_every_node_counts_once_per_node():
    grid = ByteCountingGrid(InProcessGrid(_echo, 4))
    shared = RecordDict({"arrays": ArrayRecord({"w": npy_array(np.zeros(10, np.float32))}),
                         "config": ConfigRecord({"blob": b"12345", "n": 3})})
    own = RecordDict({"config": ConfigRecord({"blob": b"1234567"})})
    messages = [Message(shared, node, "train") for node in (1, 2, 3)] + \
        [Message(own, 4, "train")]
    expected = 3 * payload_bytes(messages[0]) + payload_bytes(messages[3])
    assert payload_bytes(messages[0]) == len(npy_array(np.zeros(10, np.float32)).data) + 5
    replies = list(grid.pull_messages(grid.push_messages(messages)))
    assert grid.down == expected and len(replies) == 4
    assert grid.up == 4 * len(npy_array(np.ones(5, np.float32)).data)
