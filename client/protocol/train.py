"""The config a train message carries with the model."""

from __future__ import annotations

from flwr.app import ConfigRecord

from client.protocol.keys import REPLY_DELTA, ConfigKey


def train_config(server_round: int, version: int, task_json: str, seed: int, *,
                 compression: str | None = None, local_buffers: bool = False) -> ConfigRecord:
    """The train config asking for a delta: the round, the model version sent, the task's
    JSON, the run seed, for compressed uploads the request's JSON
    (``CompressionRequest.to_json``) and, with FedBN, ``local_buffers``."""
    config = ConfigRecord({ConfigKey.SERVER_ROUND: server_round, ConfigKey.VERSION: version,
                           ConfigKey.REPLY: REPLY_DELTA, ConfigKey.TASK: task_json,
                           ConfigKey.SEED: seed})
    if compression is not None:
        config[ConfigKey.COMPRESSION] = compression
    if local_buffers:
        config[ConfigKey.LOCAL_BUFFERS] = True
    return config
