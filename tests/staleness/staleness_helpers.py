"""Helpers for the staleness tests: quick scenarios and a scripted ClientApp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_array, npy_view
from simulations.config import load_scenario

FAST = ["train.local_epochs=1", "data.partitioner=iid"]


def scenario(*overrides: str) -> dict[str, Any]:
    """The default scenario with quick training and the given ``section.key=value``s."""
    return load_scenario("default", [*FAST, *overrides])


def scripted_app(step: float = 1e-3, examples: Callable[[int], int] = lambda pid: 10 + pid
                 ) -> ClientApp:
    """A ClientApp whose delta is ``step * (partition + 1)`` everywhere, instantly.

    Each reply is fully known in advance, so a test can recompute the server's model.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        config = msg.content["config"]
        dim = sum(npy_view(a).size for a in msg.content["arrays"].values())
        record = ArrayRecord()
        record["delta"] = npy_array(np.full(dim, step * (pid + 1), np.float32))
        metrics = MetricRecord({"num-examples": examples(pid),
                                MetricKey.BASE_VERSION: int(config[ConfigKey.VERSION])})
        return Message(RecordDict({"delta": record, "metrics": metrics}), reply_to=msg)

    return app


def scripted_delta(node: int, dim: int, step: float = 1e-3) -> np.ndarray:
    """The delta ``scripted_app`` sends from in-process node ``node`` (partition node - 1)."""
    return np.full(dim, step * node, np.float32)
