"""Client stage of update compression: encode the delta before it is uploaded.

A fedring server that compresses uploads puts "fedring.compression" in the train config:
the JSON of its ``[compression]`` section plus "run", a number naming the run (it seeds
the shared pattern and binds the residual). The client then answers with the arrays of
``aggregation.compression.RoundCodec.encode`` in a "compressed" ArrayRecord instead of
the dense "delta"; without that entry it answers as before.

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
import json
from dataclasses import asdict, dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from aggregation.compression import CompressionConfig, RoundCodec
from client import wire

COMPRESSION_KEY = "fedring.compression"  # train config: JSON of [compression] and "run"
RECORD = "compressed"  # reply: the ArrayRecord of the encoded delta
RESIDUAL = "fedring.compression.residual"  # Context.state: ArrayRecord {"residual": ...}
RESIDUAL_RUN = "fedring.compression.run"  # Context.state: ConfigRecord {"run": ...}


@dataclass(frozen=True)
class CompressionRequest:
    """What the server asks for: its ``[compression]`` settings within one run."""

    config: CompressionConfig
    run: int

    def to_json(self) -> str:
        return json.dumps({**asdict(self.config), "run": self.run}, sort_keys=True)

    @classmethod
    def from_config(cls, config: ConfigRecord) -> CompressionRequest | None:
        """The request in a train config, None when there is none."""
        raw = config.get(COMPRESSION_KEY)
        if raw is None:
            return None
        try:
            fields = json.loads(str(raw))
            run = fields.pop("run")
            if isinstance(run, bool) or not isinstance(run, int) or run < 0:
                raise ValueError(f"run must be a non-negative integer, got {run!r}")
            return cls(CompressionConfig(**fields), run)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise wire.WireError(f"bad '{COMPRESSION_KEY}' entry: {exc}") from exc

    def codec(self, dim: int, rnd: int) -> RoundCodec:
        return RoundCodec.for_round(self.config, dim, run=self.run, rnd=rnd)


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
    residual = wire.npy_view(record["residual"])
    return residual if residual.shape == (dim,) and residual.dtype == np.float32 else None


def save_residual(state: RecordDict, run: int, residual: np.ndarray) -> None:
    state[RESIDUAL] = ArrayRecord({"residual": wire.npy_array(residual)})
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
    return ArrayRecord({name: wire.npy_array(a) for name, a in arrays.items()})


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
        return "delta", wire.delta_record(delta)
    rnd = int(config.get("server-round", 0))
    seed = rounding_seed(int(config.get(wire.SEED_KEY, 0)), rnd, partition_id)
    return RECORD, compress(delta, request, rnd, state, np.random.default_rng(seed))
