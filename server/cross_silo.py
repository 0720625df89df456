"""Cross-silo rounds: the silos sum their updates over a ring; the server coordinates and checks.

Each round (``[driver] kind = "cross_silo"``) the server

1. picks the participants among the connected silos it has not excluded, and their ring
   order (seeded by the run seed and the round);
2. sends every silo one ``train.cross_silo`` message: the model, its version, the task
   and the silo's place in the ring (rendezvous address, rank, size, timeouts,
   algorithm, combine and weighting);
3. hosts the rendezvous store the silos meet at (one per run; a prefix per round);
4. receives the aggregate from the silo at ring rank 0 and a digest from every silo, and
   checks that all digests agree with each other and with the sha256 of the aggregate;
5. hands the aggregate, with every silo's fate, to the run loop (``server.run_loop``),
   which applies and records it as it does every round.

A silo whose ring fails (a peer timed out or died) reports it, naming the ring ranks it
blames. After a failure the server stops waiting once every silent silo is named, and
otherwise gives a silent silo as long as it takes to give up on its own and report
(``SiloConfig.failure_grace_s``, counted from when it joined the round's rendezvous, or
from the failure if it has not joined). The round then fails and the model stays
unchanged. Silos that caused it (an error of their own; silent and never at the
rendezvous, or named by a peer; a digest that disagrees) are excluded from later rounds,
with the reason stored, so the next round runs without them. A silo that joined the
rendezvous and that no peer names is not excluded, even when silent. The round's metrics
hold the ring's figures.

With ``[secagg] enabled`` the silos are SecAgg+ clients and the ring sums their masked
vectors instead (``server.cross_silo_secure``): the server sees only the masked sum.
With ``silo.learners`` > 1 every training message of silo rounds (plain, secure, gossip)
also carries the learner keys (``client.protocol.learners``, :class:`SiloRunContext`).
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from client.protocol.errors import WireError
from client.protocol.keys import MetricKey
from client.protocol.ring import (
    CROSS_SILO_ACTION,
    RingKey,
    RingMetric,
    RingRecord,
    RingSpec,
    RingStatus,
    aggregate_digest,
)
from client.protocol.updates import read_delta
from server.cohort import draw_cohort
from server.config import AggregationConfig
from server.cross_silo_config import SiloConfig
from server.grid_io import collect, push
from server.rounds import RoundResult, RoundSource, RunContext, mean_loss
from server.settle import unreachable
from server.store import UpdateRecord

MISSING, ERROR = "missing", "error"  # reply states besides the silo's own statuses


@dataclass
class SiloReply:
    """What one silo answered (or that it did not)."""

    node: int
    rank: int
    status: str  # ok, ring-timeout, ring-error, error or missing
    reason: str = ""
    rejected: str = ""  # why the silo kept its own update out (weight 0)
    failed: tuple[int, ...] = ()  # secure rounds: peers whose shares did not authenticate
    peers: tuple[int, ...] = ()  # ring ranks its failure report points at
    digest: str = ""
    total_weight: float = 0.0
    count: int = 0
    ring_s: float = 0.0
    num_examples: int | None = None
    weight: float | None = None
    norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    aggregate: np.ndarray | None = None


def decode_reply(node: int, rank: int, reply: Message | None,
                 words: np.dtype | None = None, *, aggregate: bool = True) -> SiloReply:
    """A silo's reply as a :class:`SiloReply` (``missing`` or ``error`` when it is no answer);
    with ``words`` ring rank 0's aggregate is a masked sum of that unsigned dtype; without
    ``aggregate`` (gossip) no silo sends one."""
    if reply is None:
        return SiloReply(node, rank, MISSING, "no reply before the deadline: the silo hung "
                                              "or died")
    gone = unreachable(reply, node)
    if gone is not None:  # the SuperLink's reply: the silo is gone, as a silent one
        return SiloReply(node, rank, MISSING, gone)
    if reply.has_error():
        return SiloReply(node, rank, ERROR, f"silo error {reply.error.code}: "
                                            f"{_first_line(reply.error.reason)}")
    result = reply.content.get(RingRecord.RESULT)
    metrics = reply.content.get("metrics")
    if not isinstance(result, ConfigRecord) or not isinstance(metrics, MetricRecord):
        return SiloReply(node, rank, ERROR, f"reply lacks '{RingRecord.RESULT}' or metrics")
    numbers = {k: float(v) for k, v in metrics.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    out = SiloReply(node, rank, str(result.get("status", ERROR)),
                    reason=str(result.get("error", "")), rejected=str(result.get("rejected", "")),
                    digest=str(result.get("digest", "")),
                    total_weight=float(result.get("total-weight", 0.0)),
                    count=int(result.get("count", 0)), ring_s=float(result.get("ring-s", 0.0)),
                    weight=numbers.get(RingMetric.WEIGHT), norm=numbers.get(RingMetric.NORM),
                    metrics=numbers)
    examples = metrics.get(MetricKey.NUM_EXAMPLES)
    out.num_examples = int(examples) if isinstance(examples, int | float) else None
    failed = result.get(RingKey.FAILED, [])
    if not isinstance(failed, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                           for v in failed):
        out.status, out.reason = ERROR, f"'{RingKey.FAILED}' is not a list of node ids"
        return out
    out.failed = tuple(failed)
    peers = result.get("peers", [])
    if isinstance(peers, list):
        out.peers = tuple(int(p) for p in peers if isinstance(p, int) and not isinstance(p, bool))
    if out.status == RingStatus.OK and rank == 0 and aggregate:
        record = reply.content.get(RingRecord.AGGREGATE)
        try:
            if not isinstance(record, ArrayRecord):
                raise WireError(f"ring rank 0's reply lacks '{RingRecord.AGGREGATE}'")
            raw = read_delta(record)
            if words is not None and raw.dtype != words:
                raise WireError(f"the masked sum has {raw.dtype} words, expected {words}")
            out.aggregate = np.array(raw, dtype=words or np.float32)
        except WireError as exc:
            out.status, out.reason = ERROR, f"bad aggregate: {exc}"
    return out


def _first_line(text: str, limit: int = 300) -> str:
    return text.strip().splitlines()[0][:limit] if text.strip() else "no details"


@dataclass
class CrossSiloOutcome:
    """One cross-silo round: the silos' replies, the verdict and who is to blame."""

    order: list[int]  # node ids in ring order
    silos: list[SiloReply]
    aggregate: np.ndarray | None = None  # set when a ring round completed
    total_weight: float = 0.0
    count: int = 0
    failure: str = ""
    blamed: dict[int, str] = field(default_factory=dict)  # node -> why it is excluded
    completed: bool = False

    def records(self, version: int) -> list[UpdateRecord]:
        """Every silo's fate: accepted, rejected (why) or dropped (no reply)."""
        out = []
        for s in self.silos:
            where = f"ring rank {s.rank} of {len(self.order)}"
            common = {"num_examples": s.num_examples, "base_version": version, "staleness": 0,
                      "norm": s.norm, "metrics": s.metrics}
            if self.completed and s.rejected:
                out.append(UpdateRecord(str(s.node), "rejected", reason=s.rejected, **common))
            elif self.completed:
                out.append(UpdateRecord(str(s.node), "accepted", weight=s.weight, **common))
            elif s.status == MISSING:
                out.append(UpdateRecord(str(s.node), "dropped", reason=f"{s.reason} ({where})"))
            else:
                why = self.blamed.get(s.node) or (f"ring failed at {where}: {s.reason}"
                                                  if s.reason else f"round failed: {self.failure}")
                out.append(UpdateRecord(str(s.node), "rejected", reason=why, **common))
        return out

    def metrics(self) -> dict[str, float]:
        """The ring's figures for the round's metrics."""
        replied = [s for s in self.silos if s.status == RingStatus.OK]
        out = {"ring_silos": float(len(self.order)), "ring_failed": float(not self.completed),
               "ring_excluded": float(len(self.blamed))}
        if self.completed:
            out.update(ring_total_weight=self.total_weight, ring_count=float(self.count),
                       ring_s=max((s.ring_s for s in replied), default=0.0))
        return out


def judge(order: list[int], replies: dict[int, Message], dim: int,
          words: np.dtype | None = None, joined: Set[int] = frozenset()) -> CrossSiloOutcome:
    """The verdict on a round's replies: the aggregate, or the failure and whom to exclude.
    With ``words`` the aggregate is a masked sum of ``dim`` such words (its weight is
    under the masks, so no weight is checked). ``joined``: the nodes that arrived at the
    round's rendezvous; a silent one of them is blamed only if a peer's report names it."""
    outcome = judge_failures(order, replies, words=words, joined=joined)
    if outcome.failure:
        return outcome
    silos = outcome.silos
    leader = silos[0]
    aggregate = leader.aggregate
    if aggregate is None or aggregate.shape != (dim,) or not np.all(np.isfinite(aggregate)):
        shape = None if aggregate is None else aggregate.shape
        outcome.blamed[leader.node] = (f"ring rank 0 sent an aggregate of shape {shape} or "
                                       f"with NaN/Inf, expected {dim} finite values")
        outcome.failure = outcome.blamed[leader.node]
        return outcome
    # The digest most silos report is the ring's result; a silo that disagrees is wrong,
    # and so is an aggregate whose own digest is not that one.
    own = aggregate_digest(aggregate, leader.total_weight, leader.count)
    consensus = blame_dissent(outcome, own)
    if own != consensus:
        outcome.blamed[leader.node] = (f"the aggregate's sha256 {own[:12]} differs from the "
                                       f"digest the silos report, {consensus[:12]}")
    if outcome.blamed:
        outcome.failure = f"digest mismatch: {len(outcome.blamed)} silo(s) disagree"
        return outcome
    if leader.total_weight <= 0 and words is None:
        outcome.failure = "no silo contributed an update (every weight was zero)"
        return outcome
    outcome.aggregate, outcome.completed = aggregate, True
    outcome.total_weight, outcome.count = leader.total_weight, leader.count
    return outcome


def judge_failures(order: list[int], replies: dict[int, Message], *,
                   words: np.dtype | None = None, joined: Set[int] = frozenset(),
                   aggregate: bool = True) -> CrossSiloOutcome:
    """The replies decoded, whom to blame for silence or errors, and the failure if any
    silo did not report success (``outcome.failure`` empty: every silo did)."""
    silos = [decode_reply(node, rank, replies.get(node), words, aggregate=aggregate)
             for rank, node in enumerate(order)]
    outcome = CrossSiloOutcome(order=list(order), silos=silos)
    named = {rank for s in silos for rank in s.peers}
    for s in silos:
        silent = s.status == MISSING and s.node not in replies  # not the SuperLink's word
        if silent and s.node in joined and s.rank not in named:
            s.reason = ("no reply before the server stopped waiting; it joined the ring's "
                        "rendezvous and no peer blames it, so it is not excluded")
        elif s.status in (MISSING, ERROR):
            outcome.blamed[s.node] = f"{s.reason} (ring rank {s.rank})"
    failed = [s for s in silos if s.status != RingStatus.OK]
    if failed:
        first = next((s for s in failed if s.status not in (MISSING, ERROR)), failed[0])
        outcome.failure = (f"{len(failed)} of {len(silos)} silo(s) failed; ring rank "
                           f"{first.rank} (node {first.node}): {first.status}: {first.reason}")
    return outcome


def blame_dissent(outcome: CrossSiloOutcome, own: str | None = None) -> str:
    """The digest most silos report (the group's result); every silo that reports another is
    blamed. With ``own`` (the digest of the aggregate ring rank 0 sent), that one wins a
    tie."""
    votes = collections.Counter(s.digest for s in outcome.silos)
    consensus = max(votes, key=lambda d: (votes[d], d == own))
    for s in outcome.silos:
        if s.digest != consensus:
            outcome.blamed[s.node] = (f"digest {s.digest[:12]} differs from the ring's "
                                      f"{consensus[:12]} (ring rank {s.rank})")
    return consensus


class Rendezvous:
    """The key-value store silos meet at: hosted by the server for the whole run."""

    def __init__(self, silo: SiloConfig) -> None:
        import torch.distributed as dist

        self.host = silo.rendezvous_host
        self.store = dist.TCPStore(silo.rendezvous_host, silo.rendezvous_port, None,
                                   is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=silo.join_timeout_s))
        self.port = int(self.store.port)


class RingCollector(Protocol):
    """Runs one cross-silo round's ring with the silos of ``order``, up to its result.
    ``central_model``: whether the round yields an aggregate for a global model (False for
    gossip, ``server.gossip``)."""

    central_model: bool

    def collect(self, rounds: CrossSiloRounds, run_id: str, rnd: int,
                order: list[int]) -> RoundResult: ...


class SiloRunContext:
    """The run's context as silo rounds see it: the same object, except that every training
    message's config also carries the silo's learner keys."""

    def __init__(self, ctx: RunContext, learners: dict[str, Any]) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_learners", learners)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ctx, name, value)

    def train_config(self, server_round: int, compression: str | None = None) -> ConfigRecord:
        config = self._ctx.train_config(server_round, compression)
        config.update(self._learners)
        return config


class CrossSiloRounds(RoundSource):
    """Synchronous rounds whose aggregate the silos compute among themselves over a ring
    (``ring``: the plain ring, or ``server.cross_silo_secure.SecureRing``)."""

    def __init__(self, ctx: RunContext, *, silo: SiloConfig, aggregation: AggregationConfig,
                 ring: RingCollector | None = None) -> None:
        spec = silo.learner_spec()
        reason = spec.refusal(ctx.config.get("train") or {})
        if reason is not None:  # at start, not in every silo's first round
            raise ValueError(reason)
        learners = spec.config()
        self.ctx: RunContext = (SiloRunContext(ctx, learners)  # type: ignore[assignment]
                                if learners else ctx)
        self.silo = silo
        self.combine, self.weight_by = aggregation.combine, aggregation.weight_by
        self.max_norm = float(aggregation.max_norm)
        self.ring = ring or PlainRing()
        self.central_model = self.ring.central_model
        self.excluded: dict[int, str] = {}  # node -> why it takes no further part
        self.rendezvous: Rendezvous | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        """The rendezvous store the silos meet at, for the whole run."""
        self.rendezvous = Rendezvous(self.silo)
        try:
            yield
        finally:
            self.rendezvous = None  # the store stops with its last reference

    def stop_reason(self) -> str | None:
        if not self.excluded:
            return None
        left = [n for n in self.ctx.grid.get_node_ids() if n not in self.excluded]
        if len(left) >= self.ctx.fed.min_clients:
            return None
        return (f"{len(left)} silo(s) left after excluding {sorted(self.excluded)}, "
                f"federation.min_clients is {self.ctx.fed.min_clients}")

    def next_round(self, run_id: str, rnd: int) -> RoundResult:
        """One cross-silo round: send, let the silos aggregate, verify."""
        ctx = self.ctx
        eligible = [n for n in ctx.wait_for_nodes() if n not in self.excluded]
        order = draw_cohort(eligible, fed=ctx.fed, concurrency=ctx.driver_config.concurrency,
                            seed=ctx.seed, rnd=rnd, dp=ctx.dp, shuffle=True)
        ctx.reporter.round_started(rnd, len(order))
        return self.ring.collect(self, run_id, rnd, order)

    def ring_records(self, run_id: str, rnd: int, order: list[int],
                     **extra: Any) -> list[ConfigRecord]:
        """Each silo's place in this round's ring (``order``), plus ``extra`` keys."""
        assert self.rendezvous is not None
        prefix = f"{run_id}/round-{rnd}/{uuid.uuid4().hex[:8]}"  # a rerun gets a fresh one
        records = []
        for rank in range(len(order)):
            spec = RingSpec(host=self.rendezvous.host, port=self.rendezvous.port, prefix=prefix,
                            rank=rank, size=len(order), join_timeout_s=self.silo.join_timeout_s,
                            ring_timeout_s=self.silo.ring_timeout_s,
                            algorithm=self.silo.algorithm, backend=self.silo.backend,
                            combine="sum" if self.combine == "sum" else "mean")
            records.append(ConfigRecord({**spec.to_dict(), **extra}))
        return records

    def messages(self, run_id: str, rnd: int, order: list[int]) -> list[Message]:
        """Each silo's training message: the model, its config and its place in the ring."""
        config = self.ctx.train_config(rnd)
        arrays = self.ctx.model_record()
        rings = self.ring_records(run_id, rnd, order, **{RingKey.WEIGHT_BY: self.weight_by,
                                                         RingKey.MAX_NORM: self.max_norm})
        return [Message(RecordDict({"arrays": arrays, "config": config, RingRecord.SPEC: ring}),
                        node, f"train.{CROSS_SILO_ACTION}", group_id=str(rnd))
                for node, ring in zip(order, rings, strict=True)]

    def joined(self, messages: list[Message]) -> set[int]:
        """The nodes of ``messages`` (one round's ring) that arrived at its rendezvous."""
        import torch.distributed as dist

        assert self.rendezvous is not None
        out = set()
        for m in messages:
            ring = m.content[RingRecord.SPEC]
            store = dist.PrefixStore(str(ring["prefix"]), self.rendezvous.store)
            if store.check([f"joined/{ring['rank']}"]):
                out.add(m.metadata.dst_node_id)
        return out

    def collect_ring(self, rnd: int, messages: list[Message]) -> dict[int, Message]:
        """Push, then collect replies until all came or the deadline passed. Once a silo
        reports a failure, stop waiting as soon as every silo still silent has been named by
        a failure report (it hangs or is gone) or has had ``failure_grace_s`` to give up on
        its own and report, counted from when it joined the rendezvous (from the failure if
        it has not joined)."""
        node_of = push(self.ctx.grid, messages)
        rank_of = {m.metadata.dst_node_id: rank for rank, m in enumerate(messages)}
        message_of = {m.metadata.message_id: m for m in messages}
        replies: dict[int, Message] = {}
        failed_at: float | None = None  # the first failure report's arrival
        joined_at: dict[str, float] = {}  # message id -> when its silo was seen at the rendezvous
        named: set[int] = set()  # ring ranks that failure reports point at
        grace = self.silo.failure_grace_s()

        def take(msg_id: str, reply: Message) -> None:
            nonlocal failed_at
            replies[node_of[msg_id]] = reply
            self.ctx.reporter.client_done(rnd, len(replies), len(messages))
            result = None if reply.has_error() else reply.content.get(RingRecord.RESULT)
            if not isinstance(result, ConfigRecord) or result.get("status") != RingStatus.OK:
                if failed_at is None:
                    failed_at = time.monotonic()
                peers = result.get("peers", []) if isinstance(result, ConfigRecord) else []
                named.update(int(p) for p in peers if isinstance(p, int))

        def failed_and_done(pending: Set[str]) -> bool:
            """After a failure: every silo still silent is one the failure reports point at
            (it hangs or is gone), or has had the grace to report on its own."""
            if failed_at is None:
                return False
            now = time.monotonic()
            silent = [i for i in pending if rank_of[node_of[i]] not in named]
            arrived = self.joined([message_of[i] for i in silent if i not in joined_at])
            joined_at.update({i: now for i in silent if node_of[i] in arrived})
            return all(now >= joined_at.get(i, failed_at) + grace for i in silent)

        collect(self.ctx.grid, node_of,
                timeout=self.ctx.driver_config.deadline(self.ctx.fed.round_timeout_s),
                poll=self.ctx.fed.poll_s, on_reply=take, stop=failed_and_done)
        return replies

    def exclude(self, rnd: int, blamed: dict[int, str]) -> None:
        """Leave ``blamed`` silos out of later rounds, with the reason."""
        for node, why in blamed.items():
            self.excluded[node] = why
            self.ctx.reporter.message(f"round {rnd}: silo {node} takes no further part: {why}")


class PlainRing:
    """The silos allreduce their updates; rank 0 sends the aggregate, all send digests."""

    central_model = True

    def collect(self, rounds: CrossSiloRounds, run_id: str, rnd: int,
                order: list[int]) -> RoundResult:
        ctx = rounds.ctx
        messages = rounds.messages(run_id, rnd, order)
        replies = rounds.collect_ring(rnd, messages)
        outcome = judge(order, replies, ctx.layout.dim, joined=rounds.joined(messages))
        rounds.exclude(rnd, outcome.blamed)
        metrics = outcome.metrics()
        metrics.update(mean_loss([(s.metrics["train_loss"], s.num_examples or 0)
                                  for s in outcome.silos if "train_loss" in s.metrics]))
        return RoundResult(aggregate=outcome.aggregate,
                           status="completed" if outcome.completed else "failed",
                           records=outcome.records(ctx.state.version), num_sampled=len(order),
                           num_replies=len(replies), total_weight=outcome.total_weight,
                           count=outcome.count, metrics=metrics,
                           note=f"cross-silo round failed: {outcome.failure}")
