"""Cross-silo rounds: the ring spec the server sends, the records, and the digest.

``train.cross_silo`` carries the model, the train config and the ``RingRecord.SPEC``
record (the :class:`RingSpec` fields plus ``RingKey.WEIGHT_BY`` and
``RingKey.MAX_NORM``; secure rounds' ``query.cross_silo`` adds ``RingKey.BITS``). Each
silo answers with a ``RingRecord.RESULT`` record (status, digest, ...) and its metrics;
ring rank 0 adds the aggregate (``RingRecord.AGGREGATE``). The server checks every
silo's digest against :func:`aggregate_digest` of that aggregate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from aggregation.ring import ALGORITHMS
from client.protocol.errors import WireError
from client.protocol.names import Names

CROSS_SILO_ACTION = "cross_silo"  # "train.cross_silo" and "query.cross_silo"
BACKENDS = ("gloo", "nccl")
COMBINES = ("mean", "sum")


class RingRecord(Names):
    """Records of cross-silo messages."""

    SPEC = "fedring.ring"  # ConfigRecord sent by the server: RingSpec fields + RingKey below
    RESULT = "fedring.ring-result"  # ConfigRecord of the reply: status, digest, ...
    AGGREGATE = "aggregate"  # ArrayRecord of ring rank 0's reply


class RingKey(Names):
    """Keys of the ring records besides the RingSpec fields."""

    WEIGHT_BY = "weight_by"  # "examples" or uniform
    MAX_NORM = "max_norm"  # a delta above this L2 norm (> 0) enters with weight 0
    BITS = "bits"  # secure rounds: the masked words' modulus 2^bits
    # The reply's result record.
    STATUS = "status"  # a RingStatus
    RING_RANK = "ring-rank"
    REJECTED = "rejected"  # why this silo's delta entered with weight 0 ("" if it did not)
    FAILED = "failed"  # secure rounds: peers whose shares did not authenticate
    DIGEST = "digest"
    TOTAL_WEIGHT = "total-weight"
    COUNT = "count"
    RING_S = "ring-s"  # seconds in the ring, as this silo saw them
    ERROR = "error"  # a failed ring: the text, the step and the ring ranks it points at
    STEP = "step"
    PEERS = "peers"


class RingMetric(Names):
    """Metrics of a cross-silo reply."""

    WEIGHT = "fedring.ring-weight"
    NORM = "fedring.delta-norm"


class RingStatus(Names):
    """Values of ``RingKey.STATUS``."""

    OK = "ok"
    TIMEOUT = "ring-timeout"
    RING_ERROR = "ring-error"


@dataclass(frozen=True)
class RingSpec:
    """Where and how one silo joins a round's ring (sent by the server)."""

    host: str  # the rendezvous store's address
    port: int
    prefix: str  # keeps rounds (and retries) apart in one store
    rank: int  # this silo's place in the ring
    size: int
    join_timeout_s: float = 120.0
    ring_timeout_s: float = 30.0
    algorithm: str = "ring"
    backend: str = "gloo"
    combine: str = "mean"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ring rank {self.rank} is not in [0, {self.size})")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} is not a TCP port")
        if not (self.join_timeout_s > 0 and self.ring_timeout_s > 0):
            raise ValueError("join_timeout_s and ring_timeout_s must be > 0")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"ring algorithm must be one of {ALGORITHMS}, got "
                             f"'{self.algorithm}'")
        if self.backend not in BACKENDS:
            raise ValueError(f"ring backend must be one of {BACKENDS}, got '{self.backend}'")
        if self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got '{self.combine}'")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ring_spec(content: RecordDict) -> tuple[ConfigRecord, RingSpec]:
    """The ring record of a cross-silo message's content and the silo's place in the ring."""
    ring = content.get(RingRecord.SPEC)
    if not isinstance(ring, ConfigRecord):
        raise WireError(f"a cross-silo message needs a '{RingRecord.SPEC}' record")
    names = {f.name for f in dataclasses.fields(RingSpec)}
    return ring, RingSpec(**{k: v for k, v in ring.items() if k in names})


def aggregate_digest(aggregate: np.ndarray, total_weight: float, count: int) -> str:
    """sha256 of the aggregate's float32 bytes (a masked sum: its words), its total weight
    and its count."""
    words = aggregate.dtype.kind == "u"
    h = hashlib.sha256(np.ascontiguousarray(aggregate, dtype=None if words else np.float32)
                       .tobytes())
    h.update(struct.pack("<dq", float(total_weight), int(count)))
    return h.hexdigest()
