"""A silo's side of a gossip round: its own model across rounds, the exchange with its
neighbours and the consensus distance.

In the round's ring process (``client.silo.ring.run_ring``, whose default process group is
the round's group) the silo sends its flattened model to each neighbour and receives
theirs (isend/irecv), and sets ``x_i = W_ii x_i + sum_j W_ij x_j``. It then measures the
spread of the models without sending one to the server: an allreduce of the sum of the
mixed models (float64) gives their mean, each silo computes ``||x_i - mean||^2``, and a
second allreduce of that scalar gives ``(1/n) sum_i ||x_i - mean||^2`` on every silo.
The digest of the sum and that total (bit-identical on every silo) is what the server
compares across silos.

The silo keeps its model in the node's ``Context.state``: the model it trains from
(``committed``) and the one it mixed in its last round (``pending``, with the round). The
next message names the last completed round the silo took part in; if that is the
pending round the silo adopts the mixed model, otherwise (the round failed) it keeps the
model it had, so a failed round changes no silo's model.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from client.protocol.npy import npy_array, npy_view
from client.protocol.ring import RingSpec
from client.silo.ring import run_ring

GOSSIP_STATE = "fedring.gossip"  # Context.state: ArrayRecord of this silo's models
GOSSIP_ROUND = "fedring.gossip-round"  # Context.state: ConfigRecord, the pending round


@dataclass(frozen=True)
class MixResult:
    """What a silo's gossip exchange produced."""

    mixed: np.ndarray  # float32, this silo's new model
    distance: float  # (1/n) sum_i ||x_i - mean||^2 over the round's silos
    digest: str  # sha256 of the group's sum of models and distance total (same everywhere)
    bytes_sent: int  # model bytes sent to neighbours
    measure_bytes: int  # bytes a ring allreduce sends to measure the distance
    seconds: float


def _gossip_step(work: torch.Tensor, spec: RingSpec, neighbours: tuple[int, ...],
                 weights: tuple[float, ...], self_weight: float) -> tuple[float, str]:
    """In the ring process: exchange with the neighbours, mix into ``work``, measure."""
    from aggregation.ring import allreduce
    from aggregation.ring.channel import Channel

    ch = Channel(None, timeout=spec.ring_timeout_s, coalesce=spec.backend == "nccl",
                 algorithm="gossip")
    received = [torch.empty_like(work) for _ in neighbours]
    pending = ch.post("exchange", sends=[(work, j) for j in neighbours],
                      recvs=list(zip(received, neighbours, strict=True)))
    ch.wait(pending)
    mixed = work * self_weight
    for w, x in zip(weights, received, strict=True):
        mixed.add_(x, alpha=w)
    work.copy_(mixed)
    total = work.double()
    allreduce(total, algorithm=spec.algorithm, timeout=spec.ring_timeout_s, out=total)
    mean = total / spec.size
    spread = torch.stack([torch.sum((work.double() - mean) ** 2)])
    allreduce(spread, algorithm=spec.algorithm, timeout=spec.ring_timeout_s, out=spread)
    h = hashlib.sha256(total.cpu().numpy().tobytes())
    h.update(struct.pack("<d", float(spread[0])))
    return float(spread[0]) / spec.size, h.hexdigest()


def mix(model: np.ndarray, neighbours: tuple[int, ...], weights: tuple[float, ...],
        self_weight: float, spec: RingSpec, *, cuda_device: int = 0) -> MixResult:
    """Join the round's group with ``model`` and mix it with the neighbours' (see the
    module docstring). Raises RingTimeout / RingError as ``client.silo.ring`` does."""
    buf = torch.from_numpy(np.ascontiguousarray(model, dtype=np.float32).copy()).share_memory_()
    op = partial(_gossip_step, neighbours=tuple(neighbours), weights=tuple(weights),
                 self_weight=float(self_weight))
    seconds, (distance, digest) = run_ring(buf, spec, cuda_device, op)
    dim = model.size
    return MixResult(mixed=buf.numpy().copy(), distance=distance, digest=digest,
                     bytes_sent=4 * dim * len(neighbours),
                     measure_bytes=round(2 * (spec.size - 1) / spec.size * 8 * dim) + 16,
                     seconds=seconds)


class HeldModel:
    """This silo's own model across gossip rounds, in the node's ``Context.state``."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    def start(self, commit_round: int, initial: np.ndarray | None) -> np.ndarray:
        """The model to train from this round: the server's ``initial`` model when sent,
        else the mixed model of ``commit_round`` if it is the pending one, else the
        model the silo had (a failed round's mix is dropped)."""
        if initial is not None:
            self._save(committed=initial)
            return np.array(initial, dtype=np.float32)
        record = self.state.get(GOSSIP_STATE)
        if not isinstance(record, ArrayRecord) or "committed" not in record:
            raise ValueError("this silo holds no gossip model and the message carries none: "
                             "the server sends the initial model only in a silo's first "
                             "gossip round")
        rounds = self.state.get(GOSSIP_ROUND)
        pending_round = rounds.get("pending", -1) if isinstance(rounds, ConfigRecord) else -1
        if "pending" in record and commit_round > 0 and pending_round == commit_round:
            model = np.array(npy_view(record["pending"]), dtype=np.float32)
            self._save(committed=model)
            return model
        return np.array(npy_view(record["committed"]), dtype=np.float32)

    def keep_pending(self, rnd: int, mixed: np.ndarray) -> None:
        """Hold ``mixed`` until a later message says whether round ``rnd`` completed."""
        record = self.state[GOSSIP_STATE]
        self.state[GOSSIP_STATE] = ArrayRecord({"committed": record["committed"],
                                                "pending": npy_array(mixed)})
        self.state[GOSSIP_ROUND] = ConfigRecord({"pending": rnd})

    def _save(self, *, committed: np.ndarray) -> None:
        self.state[GOSSIP_STATE] = ArrayRecord(
            {"committed": npy_array(np.asarray(committed, dtype=np.float32))})
        self.state[GOSSIP_ROUND] = ConfigRecord({"pending": -1})
