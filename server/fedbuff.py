"""Asynchronous rounds: FedAsync (Xie et al. 2019) and FedBuff (Nguyen et al. 2022).

Clients train continuously: up to ``driver.concurrency`` of them hold a task (the model
at some version) at once, and each reply is processed as it arrives, with staleness
``tau = version_now - base_version``.

- FedAsync mixes every accepted update in at once (Xie et al., eq. 2):
  ``w <- (1 - a) w + a (w_base + delta)`` with ``a = alpha * s(tau)``.
- FedBuff buffers updates and applies an aggregate once ``K = driver.buffer_size`` are
  accepted: ``w <- w + eta_g * sum_i b_i s(tau_i) delta_i / sum_i b_i`` where ``b_i`` is the
  update's base weight (its example count, or 1 with ``weight_by = "uniform"``, which
  gives the paper's ``sum_i s(tau_i) delta_i / K``) and ``eta_g = aggregation.server_lr``
  through the server optimizer. A client adds at most one update to a buffer.

With ``[secagg] enabled`` FedBuff's buffers are secure (``server.secure_buffer``): a
client keeps its update and reports "ready", and each buffer of K ready clients is
summed under SecAgg+, so the server never sees a single update. The secure stages take
no simulated time: the simulated clock counts training only.

With ``[compression]`` (and no secagg) each task asks its client to compress the delta
it uploads, and each reply is decoded with the codec of the task's own round (its base
version + 1), so a stale reply decodes as it was encoded. Each store round records its
bytes: ``bytes_up`` of the replies it processed (and of its secure stages),
``bytes_down`` of what was pushed since the previous aggregate.

Both run on any Grid and on either clock (see ``server.clock``); the tasks in flight are
``server.inflight``'s. On a simulated clock
events are processed in time order, ties by node id, and new tasks are handed out once
every event of that instant is processed. Every applied aggregate is one store round
(round r holds model version r when each aggregate succeeds), with the fate of every
update processed since the previous one.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from aggregation import Pipeline, Update, Verdict, WeightedMean
from client.protocol.errors import WireError
from client.protocol.secagg import SecAggAction
from server.compression import ReplyCompression
from server.inflight import Event, InFlight
from server.replies import decode_train_reply
from server.rounds import RoundResult, RoundSource, RunContext, mean_loss, update_record
from server.secure_buffer import SecureBuffer
from server.secure_round import SecureSettings, secure_result
from server.settle import mismatch, unreachable
from server.spread import PREFIX as FEDERATED
from server.store import UpdateRecord


class Buffer:
    """Updates in, one aggregate out: the plain buffer sums them in the clear.

    Its secure counterpart is ``server.secure_buffer.SecureBuffer``, with the same
    ``full``, ``members``, ``total_weight`` and ``count``.
    """

    def __init__(self, pipeline: Pipeline, *, dim: int, version: int, size: int,
                 by_examples: bool, rescale: bool = True) -> None:
        self.agg = pipeline.open_round(dim=dim, version=version)
        self.size = size
        self.rescale = rescale
        self.version = version
        self.members: set[str] = set()
        self.base_total = 0.0  # sum of weights before staleness scaling
        self._by_examples = by_examples

    @property
    def full(self) -> bool:
        return self.agg.num_accepted >= self.size

    @property
    def total_weight(self) -> float:
        return self.agg.total_weight

    @property
    def count(self) -> int:
        return self.agg.num_accepted

    def submit(self, update: Update) -> Verdict:
        verdict = self.agg.submit(update)
        if verdict.accepted:
            self.members.add(update.client_id)
            self.base_total += float(update.num_examples) if self._by_examples else 1.0
        return verdict

    def reject(self, client_id: str, reason: str) -> Verdict:
        return self.agg.reject(client_id, reason)

    def finish(self) -> np.ndarray | None:
        """The combined delta; a weighted mean is rescaled to sum(b s delta) / sum(b)."""
        delta = self.agg.finish()
        if (self.rescale and delta is not None and type(self.agg.combine) is WeightedMean
                and self.base_total > 0 and self.agg.total_weight != self.base_total):
            delta *= np.float32(self.agg.total_weight / self.base_total)
        return delta


class FedBuffRounds(RoundSource):
    """FedBuff: one aggregate every ``buffer_size`` accepted updates; with ``mixing``,
    FedAsync: every accepted update is mixed in at once with weight alpha * s(tau)."""

    def __init__(self, ctx: RunContext, *, weight_by: str,
                 compression: ReplyCompression | None, secure: SecureSettings | None,
                 mixing: bool = False) -> None:
        if ctx.dp is not None:
            raise ValueError("differential privacy accounting assumes synchronous rounds; "
                             f"driver.kind '{ctx.driver_config.kind}' cannot run with [dp]")
        self.ctx = ctx
        self.compression = compression
        self.secure = secure
        self.mixing = mixing
        self.size = 1 if mixing else ctx.driver_config.buffer_size
        staleness = ctx.driver_config.staleness_config()
        self.staleness_fn = staleness.function()
        self.max_staleness = staleness.bound()
        self.by_examples = weight_by == "examples"
        self.inflight = InFlight(ctx.grid, ctx.clock,  # the byte-counting grid
                                 deadline=ctx.driver_config.deadline(ctx.fed.round_timeout_s),
                                 wall_limit=ctx.fed.round_timeout_s, poll=ctx.fed.poll_s)
        self._ready: deque[Event] = deque()
        self._rng = np.random.default_rng([ctx.seed, 0xA5])
        self._bases: dict[int, np.ndarray] = {}  # model versions that tasks started from
        self._buffer: Buffer | SecureBuffer | None = None
        self._records: list[UpdateRecord] = []
        self._losses: list[tuple[float, float]] = []
        self._staleness: list[int] = []
        self._run_id = ""  # the run being driven (names the compression of its tasks)
        self._bytes_up = 0  # payload of the replies processed since the last aggregate

    # ---- handing out tasks

    def _dispatch(self, nodes: list[int]) -> None:
        """Fill free concurrency slots with clients that are online and idle."""
        ctx, buffer = self.ctx, self._buffer
        state = ctx.state
        limit = ctx.driver_config.concurrency_for(ctx.fed.clients_per_round(len(nodes)))
        busy = self.inflight.nodes()
        members = buffer.members if buffer is not None else set()
        candidates = [n for n in nodes if n not in busy and str(n) not in members
                      and self.inflight.free(n) and ctx.clock.online(n)]
        count = min(limit - len(self.inflight), len(candidates))
        if count <= 0:
            return
        picks = self._rng.choice(len(candidates), size=count, replace=False)
        chosen = sorted(candidates[int(i)] for i in picks)
        if state.version not in self._bases:
            self._bases[state.version] = state.params.copy()
        config = ctx.train_config(  # compressed uploads are decoded per task in _process
            state.version + 1, compression=None if self.compression is None
            else self.compression.request(self._run_id))
        content = RecordDict({"arrays": ctx.model_record(), "config": config})
        kind = "train" if self.secure is None else f"train.{SecAggAction.HOLD}"
        self.inflight.push([Message(content, node, kind, group_id=str(state.version))
                            for node in chosen], state.version)

    def _wait(self, nodes: list[int], since: float) -> list[int]:
        """Nothing in flight and no client to give work to: wait until one can take it.

        Returns the node ids to use next (the Grid's, refreshed, on the wall clock).
        """
        ctx = self.ctx
        if not ctx.clock.simulated:
            if time.monotonic() - since > ctx.fed.wait_for_nodes_s:
                raise RuntimeError(f"no client could take a task for "
                                   f"{ctx.fed.wait_for_nodes_s:g} s")
            time.sleep(ctx.fed.poll_s)
            return list(ctx.grid.get_node_ids())
        now = ctx.clock.now()
        members = self._buffer.members if self._buffer is not None else set()
        times = [t for n in nodes if str(n) not in members
                 for t in (self.inflight.busy.get(n, now), ctx.clock.next_online(n))
                 if t > now]
        if not times:
            raise RuntimeError(f"no client can take a task: the {len(members)} idle clients "
                               f"are all in the buffer of {self.size}")
        ctx.clock.advance_to(min(times))
        return nodes

    # ---- processing replies

    def _process(self, ev: Event, rnd: int) -> None:
        ctx = self.ctx
        task, buffer = ev.task, self._buffer
        assert buffer is not None
        self._bytes_up += ev.nbytes
        client_id = str(task.node)
        gone = None if ev.reply is None else unreachable(ev.reply, task.node)
        if ev.reply is None or gone is not None:  # no reply, or the SuperLink's: node gone
            if gone is not None:
                ctx.reporter.message(f"version {ctx.state.version}: dropped client "
                                     f"{client_id}: {gone}")
            self._records.append(UpdateRecord(client_id=client_id, fate="dropped",
                                              reason=gone or ev.reason,
                                              base_version=task.base_version,
                                              staleness=ctx.state.version - task.base_version))
            return
        if isinstance(buffer, SecureBuffer):
            self._offer(buffer, ev, rnd)
            return
        try:
            sender = ev.reply.metadata.src_node_id
            if sender != task.node:
                raise WireError(mismatch(task.node, sender))
            codec = None if self.compression is None else self.compression.codec(
                self._run_id, task.base_version + 1, ctx.layout.dim)  # its "server-round"
            update = decode_train_reply(ev.reply, client_id=client_id, layout=ctx.layout,
                                        base_params=self._bases[task.base_version],
                                        version=task.base_version, codec=codec)
        except WireError as exc:
            self._records.append(update_record(buffer.reject(client_id, str(exc))))
            ctx.reporter.message(f"version {ctx.state.version}: rejected client "
                                 f"{client_id}: {exc}")
            return
        verdict = buffer.submit(update)
        if verdict.accepted:
            self._staleness.append(int(verdict.staleness or 0))
            if "train_loss" in update.metrics:
                self._losses.append((update.metrics["train_loss"], float(update.num_examples)))
            ctx.reporter.client_done(rnd, buffer.agg.num_accepted, self.size)
        else:
            ctx.reporter.message(f"version {ctx.state.version}: rejected client {client_id}: "
                                 f"{verdict.reason}")
        self._records.append(update_record(verdict, update.metrics))

    def _offer(self, buffer: SecureBuffer, ev: Event, rnd: int) -> None:
        """Secure FedBuff: a ready client joins the buffer; its update stays with it."""
        task, version = ev.task, self.ctx.state.version
        assert ev.reply is not None
        record = buffer.offer(task.node, task.base_version, ev.reply)
        if record is None:
            self._staleness.append(version - task.base_version)
            self.ctx.reporter.client_done(rnd, len(buffer.ready), self.size)
            return
        self._records.append(record)
        self.ctx.reporter.message(f"version {version}: rejected client {task.node}: "
                                  f"{record.reason}")

    def _open_buffer(self) -> Buffer | SecureBuffer:
        ctx = self.ctx
        version = ctx.state.version
        if self.secure is not None:
            return SecureBuffer(self.secure, version=version, size=self.size,
                                staleness=self.staleness_fn, max_staleness=self.max_staleness)
        return Buffer(ctx.pipeline, dim=ctx.layout.dim, version=version, size=self.size,
                      by_examples=self.by_examples, rescale=not self.mixing)

    def _step(self, buffer: Buffer) -> np.ndarray | None:
        """The step to apply: the buffer's aggregate, or FedAsync's mixing step."""
        delta = buffer.finish()
        if delta is None or not self.mixing:
            return delta
        verdict = next(v for v in buffer.agg.verdicts if v.accepted)
        tau = int(verdict.staleness or 0)
        mix = self.ctx.driver_config.alpha * self.staleness_fn(tau)
        # (1 - a) w + a (w_base + delta)  ==  w + a (w_base - w + delta)
        step = self._bases[int(verdict.base_version or 0)] - self.ctx.state.params
        step += delta
        step *= np.float32(mix)
        return step

    def next_round(self, run_id: str, rnd: int) -> RoundResult:
        """Process replies until one aggregate is ready: round ``rnd``'s result."""
        ctx = self.ctx
        self._run_id = run_id
        nodes = ctx.wait_for_nodes()
        ctx.clock.bind(nodes)
        ctx.resume_clock()
        if self._buffer is None:
            self._buffer = self._open_buffer()
            ctx.reporter.round_started(rnd, self.size)
        buffer = self._buffer
        idle_since = time.monotonic()
        while not buffer.full:
            if not self._ready:
                self._dispatch(nodes)
                events = self.inflight.next_events()
                if not events:
                    nodes = self._wait(nodes, idle_since)
                    continue
                idle_since = time.monotonic()
                self._ready.extend(events)
            self._process(self._ready.popleft(), rnd)
        self._buffer = None
        if isinstance(buffer, SecureBuffer):
            result = self._secure_result(buffer, run_id, rnd)
        else:
            note = None
            try:
                step = self._step(buffer)
            except ValueError as exc:  # e.g. a robust combine refusing the buffer
                step, note = None, f"aggregation failed: {exc}"
            result = RoundResult(aggregate=step, status="completed" if step is not None
                                 else "failed", records=self._records, num_sampled=0,
                                 num_replies=0, total_weight=buffer.total_weight,
                                 count=buffer.count, note=note)
        self._prune_bases()
        result.records = self._records
        result.num_sampled = len(self._records)
        result.num_replies = len(self._records) - result.counts()["dropped"]
        if self._staleness:
            result.metrics["staleness_mean"] = float(np.mean(self._staleness))
        result.metrics.update(self._traffic())
        result.metrics.update(mean_loss(self._losses))
        self._records, self._losses, self._staleness = [], [], []
        return result

    def _secure_result(self, buffer: SecureBuffer, run_id: str, rnd: int) -> RoundResult:
        """Secure FedBuff: the buffer's secure sum as FedBuff's aggregate."""
        assert self.secure is not None
        ctx = self.ctx
        before = ctx.grid.up
        outcome = buffer.finish(ctx.grid, dim=ctx.layout.dim, run_id=run_id, rnd=rnd,
                                timeout=ctx.fed.round_timeout_s, poll=ctx.fed.poll_s)
        self._bytes_up += ctx.grid.up - before  # the secure stages' replies
        self._records += buffer.records()
        return secure_result(outcome, self.secure.aggregate(outcome, None, reporter=ctx.reporter),
                             num_sampled=0, metrics={}, what="secure aggregation of the buffer")

    def _traffic(self) -> dict[str, float]:
        """Bytes of this aggregate: the replies it processed (each counted in the round
        that handles it) and the tasks pushed since the previous aggregate."""
        down = self.ctx.grid.since_last()["bytes_down"]
        up, self._bytes_up = self._bytes_up, 0
        return {"bytes_up": float(up), "bytes_down": down}

    def _prune_bases(self) -> None:
        keep = {t.base_version for t in self.inflight.tasks.values()}
        keep |= {ev.task.base_version for ev in self._ready}
        for version in [v for v in self._bases if v not in keep]:
            del self._bases[version]

    def finish(self, run_id: str, summary: dict[str, Any]) -> None:
        """Record what arrived after the last applied aggregate as an aborted round."""
        ctx = self.ctx
        version = ctx.state.version
        replies = (sum(r.fate != "dropped" for r in self._records)
                   + sum(ev.reply is not None for ev in self._ready))
        records = [r if r.fate != "accepted" else UpdateRecord(
            client_id=r.client_id, fate="dropped", reason="the run ended before its buffer "
            "was applied", num_examples=r.num_examples, base_version=r.base_version,
            staleness=r.staleness, norm=r.norm, weight=r.weight, metrics=r.metrics)
            for r in self._records]
        records += [UpdateRecord(client_id=str(ev.task.node), fate="dropped",
                                 reason="the run ended before it was processed",
                                 base_version=ev.task.base_version,
                                 staleness=version - ev.task.base_version)
                    for ev in self._ready]
        if records:
            last = ctx.state.history[-1] if ctx.state.history else {}
            # the model's central figures; no client evaluated in this round
            last = {k: v for k, v in last.items() if not k.startswith(f"{FEDERATED}_")}
            self._bytes_up += sum(ev.nbytes for ev in self._ready)
            ctx.store.record_round(run_id, round=ctx.state.round + 1, model_version=version,
                                   status="aborted", num_sampled=len(records),
                                   num_replies=replies,
                                   num_rejected=sum(r.fate == "rejected" for r in records),
                                   num_dropped=sum(r.fate == "dropped" for r in records),
                                   metrics={**last, **self._traffic()}, updates=records)
        self._records, self._ready = [], deque()
        summary["buffer_size"] = self.size
