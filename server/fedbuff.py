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
update processed since the previous one; the replies pulled but not processed when the
run ends come back as one aborted round (:meth:`FedBuffRounds.leftover`). The buffer,
plain or secure, is a ``server.reply_buffer.ReplyBuffer``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from aggregation import Update
from client.protocol.errors import WireError
from client.protocol.secagg import SecAggAction
from server.compression import ReplyCompression
from server.inflight import Event, InFlight, Task
from server.replies import decode_train_reply
from server.reply_buffer import PlainBuffer, ReplyBuffer
from server.rounds import RoundResult, RoundSource, RunContext
from server.secure_aggregation import SecureAggregation
from server.secure_buffer import SecureBuffer
from server.settle import mismatch, unreachable
from server.store import UpdateRecord
from server.wire_bytes import ByteCountingGrid

NO_TRAFFIC = {"bytes_up": 0.0, "bytes_down": 0.0}


class FedBuffRounds(RoundSource):
    """FedBuff: one aggregate every ``buffer_size`` accepted updates; with ``mixing``,
    FedAsync: every accepted update is mixed in at once with weight alpha * s(tau)."""

    def __init__(self, ctx: RunContext, *, weight_by: str,
                 compression: ReplyCompression | None, secure: SecureAggregation | None,
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
        self._buffer: ReplyBuffer | None = None
        self._records: list[UpdateRecord] = []
        self._run_id = ""  # the run being driven (names the compression of its tasks)
        self._bytes_up = 0  # payload of the replies processed since the last aggregate
        self._traffic_due = dict(NO_TRAFFIC)  # the bytes of the round last returned

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
        record = buffer.admit(task, ev.reply)
        if record is None or record.fate == "accepted":
            ctx.reporter.client_done(rnd, buffer.filled, self.size)
        else:
            ctx.reporter.message(f"version {ctx.state.version}: rejected client {client_id}: "
                                 f"{record.reason}")
        if record is not None:
            self._records.append(record)

    def _decode(self, task: Task, reply: Message) -> Update:
        """A plain reply's update, decoded against the model its task started from, with
        the codec of the task's own round (raises ``WireError`` on a bad reply)."""
        sender = reply.metadata.src_node_id
        if sender != task.node:
            raise WireError(mismatch(task.node, sender))
        codec = None if self.compression is None else self.compression.codec(
            self._run_id, task.base_version + 1, self.ctx.layout.dim)  # its "server-round"
        return decode_train_reply(reply, client_id=str(task.node), layout=self.ctx.layout,
                                  base_params=self._bases[task.base_version],
                                  version=task.base_version, codec=codec)

    def _open_buffer(self) -> ReplyBuffer:
        ctx = self.ctx
        if self.secure is not None:
            return SecureBuffer(ctx, self.secure, size=self.size, staleness=self.staleness_fn,
                                max_staleness=self.max_staleness)
        return PlainBuffer(ctx.pipeline, self._decode, dim=ctx.layout.dim,
                           version=ctx.state.version, size=self.size,
                           by_examples=self.by_examples, rescale=not self.mixing)

    def _mix(self, delta: np.ndarray, accepted: UpdateRecord) -> np.ndarray:
        """FedAsync's step for the one ``accepted`` update with combined ``delta``."""
        tau = int(accepted.staleness or 0)
        mix = self.ctx.driver_config.alpha * self.staleness_fn(tau)
        # (1 - a) w + a (w_base + delta)  ==  w + a (w_base - w + delta)
        step = self._bases[int(accepted.base_version or 0)] - self.ctx.state.params
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
        before = ctx.grid.up
        result = buffer.close(run_id, rnd)
        self._bytes_up += ctx.grid.up - before  # a secure buffer's stages' replies
        self._records += result.records
        if self.mixing and result.aggregate is not None:
            accepted = next(r for r in self._records if r.fate == "accepted")
            result.aggregate = self._mix(result.aggregate, accepted)
        self._prune_bases()
        result.records = self._records
        result.num_sampled = len(self._records)
        result.num_replies = len(self._records) - result.counts()["dropped"]
        result.metrics.update(buffer.figures())
        self._traffic_due = self._traffic()
        self._records = []
        return result

    def traffic(self, grid: ByteCountingGrid) -> dict[str, float]:
        """The bytes of the round last returned (each reply counted in the round that
        processes it, so not always when the grid pulled it) and of what ran since."""
        due, self._traffic_due = self._traffic_due, dict(NO_TRAFFIC)
        return {key: due[key] + value for key, value in grid.since_last().items()}

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

    def leftover(self) -> RoundResult | None:
        """The replies pulled after the last applied aggregate and never processed, as an
        aborted round of dropped updates (every processed reply is in an applied round)."""
        version = self.ctx.state.version
        records = [UpdateRecord(client_id=str(ev.task.node), fate="dropped",
                                reason="the run ended before it was processed",
                                base_version=ev.task.base_version,
                                staleness=version - ev.task.base_version)
                   for ev in self._ready]
        if not records:
            return None
        replies = sum(ev.reply is not None for ev in self._ready)
        self._bytes_up += sum(ev.nbytes for ev in self._ready)
        self._ready = deque()
        self._traffic_due = self._traffic()
        return RoundResult(aggregate=None, status="aborted", records=records,
                           num_sampled=len(records), num_replies=replies)

    def finish(self, run_id: str, summary: dict[str, Any]) -> None:
        summary["buffer_size"] = self.size
