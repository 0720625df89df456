"""Synthetic secure-aggregation clients: fixed deltas, no training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from client.protocol.keys import ConfigKey, MetricKey
from client.secure_client import register_secagg


@dataclass
class Synthetic:
    """A local update that needs no training: a fixed vector and example count per node."""

    delta: np.ndarray
    metrics: MetricRecord


def synthetic_inputs(n: int, dim: int, seed: int = 0) -> dict[int, tuple[np.ndarray, int]]:
    """Node id -> (delta, num_examples); some coordinates exceed a clip range of 1."""
    rng = np.random.default_rng(seed)
    return {node: ((rng.standard_normal(dim) * 0.6).astype(np.float32),
                   int(rng.integers(5, 200))) for node in range(1, n + 1)}


def synthetic_app(inputs: dict[int, tuple[np.ndarray, int]],
                  seen: list[tuple[int, str, bytes]] | None = None) -> ClientApp:
    """A ClientApp answering the secure-aggregation messages with ``inputs``."""

    def local_update(msg: Message, context: Context) -> Synthetic:
        delta, examples = inputs[int(context.node_id)]
        return Synthetic(delta, MetricRecord({MetricKey.NUM_EXAMPLES: examples}))

    app = ClientApp()
    register_secagg(app, local_update)
    if seen is None:
        return app

    def recording(msg: Message, context: Context) -> Message:
        record = msg.content.get("secagg")
        seen.append((int(context.node_id), msg.metadata.message_type,
                     record["msg"] if isinstance(record, ConfigRecord) else b""))
        return app(msg, context)

    return recording  # type: ignore[return-value]


def empty_model() -> tuple[ArrayRecord, ConfigRecord]:
    return ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0})
