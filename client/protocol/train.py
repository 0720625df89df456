"""The config a train message carries with the model."""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ConfigRecord

from client.protocol.errors import WireError
from client.protocol.keys import REPLY_DELTA, ConfigKey


def train_config(server_round: int, version: int, task_json: str, seed: int, *,
                 compression: str | None = None, local_buffers: bool = False,
                 center: tuple[np.ndarray, float] | None = None,
                 client_momentum: float = 0.0, dp_sgd_prior_rounds: int = 0) -> ConfigRecord:
    """The train config asking for a delta: the round, the model version sent, the task's
    JSON, the run seed, for compressed uploads the request's JSON
    (``CompressionRequest.to_json``), with FedBN ``local_buffers``; ``center``: the centre
    and radius each client clips its delta around before it replies (client-side centered
    clipping); ``client_momentum`` beta > 0: each client sends its momentum over its own
    deltas (``client.momentum``); ``dp_sgd_prior_rounds`` > 0 (a resumed run): the DP-SGD
    rounds any client may have trained before, which a client that lost its state composes
    (``client.dp_sgd``)."""
    config = ConfigRecord({ConfigKey.SERVER_ROUND: server_round, ConfigKey.VERSION: version,
                           ConfigKey.REPLY: REPLY_DELTA, ConfigKey.TASK: task_json,
                           ConfigKey.SEED: seed})
    if compression is not None:
        config[ConfigKey.COMPRESSION] = compression
    if local_buffers:
        config[ConfigKey.LOCAL_BUFFERS] = True
    if center is not None:
        vector, radius = center
        config[ConfigKey.CENTER] = np.asarray(vector, dtype="<f4").tobytes()
        config[ConfigKey.CLIP_RADIUS] = float(radius)
    if client_momentum:
        config[ConfigKey.CLIENT_MOMENTUM] = float(client_momentum)
    if dp_sgd_prior_rounds:
        config[ConfigKey.DP_SGD_PRIOR_ROUNDS] = int(dp_sgd_prior_rounds)
    return config


def read_dp_sgd_prior_rounds(config: ConfigRecord) -> int:
    """The DP-SGD rounds a train config says a client may have trained before (0: none
    said); WireError when malformed."""
    rounds = config.get(ConfigKey.DP_SGD_PRIOR_ROUNDS, 0)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise WireError(f"config '{ConfigKey.DP_SGD_PRIOR_ROUNDS}' must be an integer >= 0, "
                        f"got {rounds!r}")
    return rounds


def read_client_momentum(config: ConfigRecord) -> float:
    """The client momentum beta of a train config (0: none); WireError when malformed."""
    beta = config.get(ConfigKey.CLIENT_MOMENTUM, 0.0)
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 1:
        raise WireError(f"config '{ConfigKey.CLIENT_MOMENTUM}' must be a number in [0, 1), "
                        f"got {beta!r}")
    return float(beta)


def read_center(config: ConfigRecord, dim: int) -> tuple[np.ndarray, float] | None:
    """The centre and radius of a train config (None when it asks for no clipping);
    WireError when they are malformed."""
    raw, radius = config.get(ConfigKey.CENTER), config.get(ConfigKey.CLIP_RADIUS)
    if raw is None and radius is None:
        return None
    if not isinstance(raw, bytes) or len(raw) != 4 * dim:
        raise WireError(f"config '{ConfigKey.CENTER}' must be {4 * dim} bytes (the centre, "
                        f"float32), got {type(raw).__name__} of {len(raw or b'')} bytes")
    if isinstance(radius, bool) or not isinstance(radius, int | float) or \
            not (math.isfinite(radius) and radius > 0):
        raise WireError(f"config '{ConfigKey.CLIP_RADIUS}' must be a number > 0, got "
                        f"{radius!r}")
    center = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(center)):
        raise WireError(f"config '{ConfigKey.CENTER}' has NaN or Inf values")
    return center, float(radius)
