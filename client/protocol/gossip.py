"""Gossip rounds: what ``train.gossip`` carries besides the ring spec, and what silos report.

A gossip message is a cross-silo message (``client.protocol.ring``: the train config and
the ``RingRecord.SPEC`` record with the silo's rank in the round's group and the
rendezvous) whose ring record also holds the :class:`GossipKey` entries: the silo's
neighbours (group ranks), their mixing weights and its own, and the last completed
round the silo took part in (``commit_round``: a silo adopts the model it mixed in that
round, else keeps the one it had). The ``arrays`` record (the
server's initial model) comes only in a silo's first gossip message. The reply holds no
model: its ``RingRecord.RESULT`` (status, digest of the group's consensus sum, or the
failure) and metrics (:class:`GossipMetric`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ConfigRecord

from client.protocol.errors import WireError
from client.protocol.names import Names

GOSSIP_ACTION = "gossip"  # "train.gossip"
WEIGHT_TOLERANCE = 1e-6  # how far a silo's weights may sum from 1


class GossipKey(Names):
    """Keys of a gossip message's ring record besides the RingSpec fields."""

    NEIGHBOURS = "gossip.neighbours"  # group ranks of this silo's neighbours
    WEIGHTS = "gossip.weights"  # W_ij for each neighbour, in that order
    SELF_WEIGHT = "gossip.self-weight"  # W_ii
    COMMIT_ROUND = "gossip.commit-round"  # the last completed round this silo was in (0: none)


class GossipMetric(Names):
    """Metrics of a gossip reply (besides num-examples and train_loss)."""

    ACCURACY = "heldout_acc"  # the mixed model on the task's held-out split (absent
    # when the task holds none out)
    LOSS = "heldout_loss"
    HELDOUT = "heldout_examples"
    DISTANCE = "consensus_distance"  # (1/n) sum_i ||x_i - mean||^2 over the round's silos
    BYTES = "gossip_bytes"  # bytes of model this silo sent to its neighbours
    MEASURE_BYTES = "consensus_bytes"  # bytes it sent to measure the consensus distance


@dataclass(frozen=True)
class GossipSpec:
    """One silo's part of a gossip round: its neighbours and weights."""

    rank: int
    size: int
    neighbours: tuple[int, ...]
    weights: tuple[float, ...]
    self_weight: float
    commit_round: int

    @classmethod
    def of(cls, ring: ConfigRecord, rank: int, size: int) -> GossipSpec:
        """The gossip entries of a ring record, checked (a WireError names what is wrong)."""
        nbrs, weights = ring.get(GossipKey.NEIGHBOURS), ring.get(GossipKey.WEIGHTS)
        own = ring.get(GossipKey.SELF_WEIGHT)
        commit = ring.get(GossipKey.COMMIT_ROUND, 0)
        if not isinstance(nbrs, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                             for v in nbrs):
            raise WireError(f"'{GossipKey.NEIGHBOURS}' must be a list of group ranks")
        if not isinstance(weights, list) or len(weights) != len(nbrs) or any(
                isinstance(v, bool) or not isinstance(v, int | float) for v in weights):
            raise WireError(f"'{GossipKey.WEIGHTS}' must hold one number per neighbour")
        if isinstance(own, bool) or not isinstance(own, int | float):
            raise WireError(f"'{GossipKey.SELF_WEIGHT}' must be a number")
        if isinstance(commit, bool) or not isinstance(commit, int):
            raise WireError(f"'{GossipKey.COMMIT_ROUND}' must be a round number")
        if len(set(nbrs)) != len(nbrs) or any(not 0 <= j < size or j == rank for j in nbrs):
            raise WireError(f"neighbours {nbrs} of rank {rank} are not distinct other ranks "
                            f"of a group of {size}")
        if any(w < 0 for w in weights) or own < 0 or \
                abs(sum(weights) + own - 1.0) > WEIGHT_TOLERANCE:
            raise WireError(f"mixing weights {weights} and {own} must be >= 0 and sum to 1")
        return cls(rank=rank, size=size, neighbours=tuple(nbrs),
                   weights=tuple(float(w) for w in weights), self_weight=float(own),
                   commit_round=commit)
