"""Gossip rounds (D-PSGD, Lian et al. NeurIPS 2017): the silos average their own models
with their neighbours'; the server only admits silos, hands out the topology and records.

``[driver] kind = "gossip"`` runs on the cross-silo machinery (``server.cross_silo``):
:class:`GossipCollector` is the collector a :class:`~server.cross_silo.CrossSiloRounds` runs
each round with the silos it picked (connected, not excluded). It

1. draws the round's topology over their ranks (``[gossip] topology``, seeded by the run
   seed and the round) and its Metropolis–Hastings weights (``aggregation.gossip``);
2. sends every silo one ``train.gossip`` message: its place in the round's group (the
   run's rendezvous store, a prefix per round), its neighbours and their weights, its
   own weight and the last completed round it took part in; the server's initial model
   goes only into a silo's first message;
3. waits for the replies as for a ring (``CrossSiloRounds.collect_ring``) and judges them
   as a ring's (``judge_failures``): silent or failing silos are blamed and excluded from
   later rounds, and every silo's digest of the group's consensus sum must agree.

A reply holds metrics only: the mixed model's accuracy and loss on the silo's held-out
split (``[data] client_test_fraction``), the consensus distance (measured by the silos
in their group), the bytes the silo sent. The round's ``accuracy`` and ``loss`` are the
means over its silos, and each silo's figures are its evaluation record
(``RoundResult.evaluations``: accepted; a silo dropped or rejected from the round, or
one without figures, with the reason), as a federated evaluation round records. There is
no aggregate: the run loop applies nothing and evaluates no central model
(``central_model = False``). A failed round leaves every silo's model as it was: a silo
adopts the model it mixed only once a later message says that round completed.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict

from aggregation.gossip import metropolis_hastings, topology
from client.protocol.errors import WireError
from client.protocol.evaluation import EvalKey, read_evaluation
from client.protocol.gossip import GOSSIP_ACTION, GossipKey, GossipMetric
from client.protocol.keys import MetricKey, RecordName
from client.protocol.ring import RingRecord, RingStatus
from server.cross_silo import CrossSiloRounds, blame_dissent, judge_failures
from server.cross_silo_config import GossipConfig
from server.rounds import RoundResult, mean_loss
from server.store import EvalRecord, UpdateRecord


class GossipCollector:
    """The collector of gossip rounds: each silo mixes its model with its neighbours' in
    the round's topology (a ring or a random graph, ``[gossip] topology``), not a ring
    sum (see the module docstring)."""

    central_model = False  # the run loop applies and evaluates nothing

    def __init__(self, config: GossipConfig) -> None:
        self.config = config
        self.seeded: set[int] = set()  # silos that were sent the initial model
        self.last_completed: dict[int, int] = {}  # silo -> last completed round it was in

    def mixing(self, seed: int, rnd: int, n: int) -> tuple[list[list[int]], np.ndarray]:
        """Round ``rnd``'s neighbours (by rank) and mixing matrix for ``n`` silos."""
        adjacency = topology(self.config.topology, n, degree=self.config.degree,
                             seed=[seed, rnd])
        return [sorted(a) for a in adjacency], metropolis_hastings(adjacency)

    def messages(self, rounds: CrossSiloRounds, run_id: str, rnd: int, order: list[int],
                 neighbours: list[list[int]], w: np.ndarray) -> list[Message]:
        """Each silo's ``train.gossip`` message (``order``: node ids by rank)."""
        ctx = rounds.ctx
        config = ctx.train_config(rnd)
        model = ctx.model_record() if any(n not in self.seeded for n in order) else None
        out = []
        for rank, ring in enumerate(rounds.ring_records(run_id, rnd, order)):
            node = order[rank]
            ring[GossipKey.NEIGHBOURS] = neighbours[rank]
            ring[GossipKey.WEIGHTS] = [float(w[rank, j]) for j in neighbours[rank]]
            ring[GossipKey.SELF_WEIGHT] = float(w[rank, rank])
            ring[GossipKey.COMMIT_ROUND] = self.last_completed.get(node, 0)
            content = RecordDict({RecordName.CONFIG: config, RingRecord.SPEC: ring})
            if node not in self.seeded and model is not None:
                content[RecordName.ARRAYS] = model
            out.append(Message(content, node, f"train.{GOSSIP_ACTION}", group_id=str(rnd)))
        return out

    def collect(self, rounds: CrossSiloRounds, run_id: str, rnd: int,
                order: list[int]) -> RoundResult:
        ctx = rounds.ctx
        neighbours, w = self.mixing(ctx.seed, rnd, len(order))
        messages = self.messages(rounds, run_id, rnd, order, neighbours, w)
        replies = rounds.collect_ring(rnd, messages)
        outcome = judge_failures(order, replies, joined=rounds.joined(messages),
                                 aggregate=False)
        if not outcome.failure:
            blame_dissent(outcome)
            if outcome.blamed:
                outcome.failure = f"digest mismatch: {len(outcome.blamed)} silo(s) disagree"
            else:
                outcome.completed = True
        rounds.exclude(rnd, outcome.blamed)
        self.seeded.update(n for n in order if n not in outcome.blamed)
        if outcome.completed:
            self.last_completed.update({n: rnd for n in order})
        ok = [s for s in outcome.silos if s.status == RingStatus.OK]
        metrics = {"gossip_silos": float(len(order)),
                   "gossip_failed": float(not outcome.completed),
                   "gossip_excluded": float(len(outcome.blamed)),
                   "gossip_edges": float(sum(len(nb) for nb in neighbours) // 2)}
        if outcome.completed:
            metrics.update(round_metrics([s.metrics for s in ok]))
            metrics["ring_s"] = max((s.ring_s for s in ok), default=0.0)
        metrics.update(mean_loss([(s.metrics["train_loss"], s.num_examples or 0)
                                  for s in ok if "train_loss" in s.metrics]))
        records = outcome.records(ctx.state.version)
        return RoundResult(aggregate=None,
                           status="completed" if outcome.completed else "failed",
                           records=records, num_sampled=len(order),
                           num_replies=len(replies), metrics=metrics,
                           evaluations=[silo_evaluation(r) for r in records],
                           note=f"gossip round failed: {outcome.failure}; every silo keeps "
                                "the model it had")


def round_metrics(silos: list[dict[str, float]]) -> dict[str, float]:
    """A completed round's figures from its silos' metrics: accuracy and loss (means over
    the silos of their held-out figures), the spread of the accuracy, the consensus
    distance and the bytes on the wire."""
    acc = [m[GossipMetric.ACCURACY] for m in silos if GossipMetric.ACCURACY in m]
    loss = [m[GossipMetric.LOSS] for m in silos if GossipMetric.LOSS in m]
    out: dict[str, float] = {}
    if acc:
        out.update(accuracy=float(np.mean(acc)), accuracy_min=float(np.min(acc)),
                   accuracy_max=float(np.max(acc)))
    if loss:
        out["loss"] = float(np.mean(loss))
    distances = [m[GossipMetric.DISTANCE] for m in silos if GossipMetric.DISTANCE in m]
    if distances:
        out[GossipMetric.DISTANCE] = float(distances[0])  # the same on every silo
    for key in (GossipMetric.BYTES, GossipMetric.MEASURE_BYTES):
        out[key] = float(sum(m.get(key, 0.0) for m in silos))
    return out


def silo_evaluation(update: UpdateRecord) -> EvalRecord:
    """A silo's evaluation record from its update's: an accepted silo's figures for its
    mixed model on its held-out split (rejected, with the reason, when they are missing or
    malformed); a dropped or rejected silo with the update's reason (its mixed model is
    not kept)."""
    if update.fate != "accepted":
        return EvalRecord(update.client_id, update.fate, reason=update.reason)
    m = update.metrics or {}
    if GossipMetric.ACCURACY not in m:
        return EvalRecord(update.client_id, "rejected",
                          reason="the silo reported no held-out figures (no held-out split: "
                                 "set data.client_test_fraction > 0)")
    figures = {EvalKey.ACCURACY: m[GossipMetric.ACCURACY],
               EvalKey.LOSS: m.get(GossipMetric.LOSS, float("nan")),
               MetricKey.NUM_EXAMPLES: m.get(GossipMetric.HELDOUT, 0)}
    try:
        ev = read_evaluation(MetricRecord(figures))
    except (WireError, TypeError, ValueError) as exc:
        return EvalRecord(update.client_id, "rejected", reason=f"held-out figures: {exc}")
    return EvalRecord(update.client_id, "accepted", num_examples=ev.num_examples,
                      loss=ev.loss, accuracy=ev.accuracy)
