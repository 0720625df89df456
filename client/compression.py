"""Client stage of update compression: encode the delta before it is uploaded.

When the train config holds a compression request (``client.protocol.compression``) the
client answers with the arrays of ``aggregation.compression.RoundCodec.encode`` in a
"compressed" ArrayRecord instead of the dense "delta"; without one it answers as before.

Under secure aggregation the same request rides in the secure round's SETUP record, for
top-k on a shared pattern only: :func:`select_shared` picks the round's ``k`` coordinates,
which the client then weights, quantizes and masks instead of the whole delta.

With error feedback the residual (what compression has left out so far) lives in the
node's ``Context.state``, so it carries over between rounds on every engine, also where
each message starts a fresh process (a Flower deployment); a residual of another run or
of another model size is discarded. QSGD's rounding is seeded from (seed, round,
partition), so runs are reproducible.
"""

from __future__ import annotations

import hashlib

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from client.protocol.compression import CompressionRequest
from client.protocol.keys import ConfigKey, RecordName
from client.protocol.npy import npy_array, npy_view
from client.protocol.updates import delta_record

RESIDUAL = "fedring.compression.residual"  # Context.state: ArrayRecord {"residual": ...}
RESIDUAL_RUN = "fedring.compression.run"  # Context.state: ConfigRecord {"run": ...}


def rounding_seed(seed: int, rnd: int, partition_id: int) -> int:
    """The seed of a client's stochastic rounding in a round (not secret: QSGD's noise)."""
    digest = hashlib.sha256(f"fedring-compression:{seed}:{rnd}:{partition_id}".encode())
    return int.from_bytes(digest.digest()[:8], "little")


def load_residual(state: RecordDict, run: int, dim: int) -> np.ndarray | None:
    """This node's error-feedback residual in ``run`` (a read-only view), if it has one."""
    owner, record = state.get(RESIDUAL_RUN), state.get(RESIDUAL)
    if not (isinstance(owner, ConfigRecord) and owner.get("run") == run
            and isinstance(record, ArrayRecord) and "residual" in record):
        return None
    residual = npy_view(record["residual"])
    return residual if residual.shape == (dim,) and residual.dtype == np.float32 else None


def save_residual(state: RecordDict, run: int, residual: np.ndarray) -> None:
    state[RESIDUAL] = ArrayRecord({"residual": npy_array(residual)})
    state[RESIDUAL_RUN] = ConfigRecord({"run": run})


def compress(delta: np.ndarray, request: CompressionRequest, rnd: int, state: RecordDict,
             rng: np.random.Generator) -> ArrayRecord:
    """The encoded delta (plus the carried residual), updating the residual in ``state``."""
    codec = request.codec(delta.size, rnd)
    feedback = request.config.error_feedback
    residual = load_residual(state, request.run, delta.size) if feedback else None
    u = delta if residual is None else delta + residual
    arrays = codec.encode(u, rng)
    if feedback:
        save_residual(state, request.run, u - codec.decode(arrays))
    return ArrayRecord({name: npy_array(a) for name, a in arrays.items()})


def select_shared(delta: np.ndarray, request: CompressionRequest, rnd: int, state: RecordDict,
                  clip_range: float) -> np.ndarray:
    """Shared-pattern top-k under secure aggregation: the round's ``k`` coordinates of the
    delta (plus the carried residual), each clipped to ``[-clip_range, clip_range]``.

    With error feedback the residual keeps everything not sent: the other coordinates and
    what clipping took off the sent ones.
    """
    cfg = request.config
    if cfg.kind != "topk" or not cfg.shared_pattern:
        raise ValueError(f"a secure round sums only a shared pattern: got kind '{cfg.kind}', "
                         f"shared_pattern {cfg.shared_pattern}")
    pattern = request.codec(delta.size, rnd).pattern
    assert pattern is not None
    residual = load_residual(state, request.run, delta.size) if cfg.error_feedback else None
    u = np.asarray(delta, dtype=np.float32) if residual is None else delta + residual
    sent = np.clip(u[pattern], -clip_range, clip_range)
    if cfg.error_feedback:
        rest = u.copy() if residual is None else u  # never write into the caller's delta
        rest[pattern] -= sent
        save_residual(state, request.run, rest)
    return sent


def reply_record(config: ConfigRecord, delta: np.ndarray, state: RecordDict,
                 partition_id: int) -> tuple[str, ArrayRecord]:
    """(record name, record) of a delta reply: "compressed" if the server asks, else "delta"."""
    request = CompressionRequest.from_config(config)
    if request is None or not request.config.enabled:
        return RecordName.DELTA, delta_record(delta)
    rnd = int(config.get(ConfigKey.SERVER_ROUND, 0))
    seed = rounding_seed(int(config.get(ConfigKey.SEED, 0)), rnd, partition_id)
    return RecordName.COMPRESSED, compress(delta, request, rnd, state, np.random.default_rng(seed))
