"""Asynchronous round drivers: FedAsync (Xie et al. 2019) and FedBuff (Nguyen et al. 2022).

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

Both run on any Grid and on either clock (see ``server.clock``). On a simulated clock
events are processed in time order, ties by node id, and new tasks are handed out once
every event of that instant is processed. Every applied aggregate is one store round
(round r holds model version r when each aggregate succeeds), with the fate of every
update processed since the previous one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from aggregation import Pipeline, Update, Validate, Verdict, Weight, WeightedMean
from client import secure_client, wire
from client.compression import COMPRESSION_KEY
from server.clock import Clock
from server.dp import DPController
from server.exchange import collect
from server.replies import decode_train_reply
from server.reporter import Reporter
from server.secure_buffer import SecureBuffer
from server.secure_round import session_id
from server.store import Store, UpdateRecord
from server.sync_driver import SyncDriver, _record, wait_for_nodes
from server.task import ServerTask
from server.wire_bytes import payload_bytes


@dataclass
class Task:
    """One model sent to one client and not yet settled."""

    msg_id: str
    node: int
    base_version: int
    seq: int
    pushed_at: float  # wall-clock seconds (time.monotonic)
    end: float | None = None  # simulated time it settles; None on the wall clock
    fate: str = "reply"  # "reply", or (simulated) "lost" / "late" when no reply will count
    reason: str | None = None


@dataclass
class Event:
    """A task settled at ``time``: its reply, or None with the reason."""

    task: Task
    time: float
    reply: Message | None
    reason: str | None = None
    nbytes: int = 0  # payload bytes of the reply pulled (also when it does not count)


class InFlight:
    """Tasks handed to clients, settled in time order on either clock.

    On the simulated clock a task settles at its reply's simulated arrival, when its
    client goes offline (lost) or at the deadline (late, its client stays busy until it
    would have finished); the reply is pulled from the Grid then, so the in-process
    engine computes it lazily. On the wall clock replies are polled and a task without a
    reply within the deadline settles as late.
    """

    def __init__(self, grid: Grid, clock: Clock, *, deadline: float, wall_limit: float,
                 poll: float) -> None:
        self.grid = grid
        self.clock = clock
        self.deadline = deadline
        self.wall_limit = wall_limit
        self.poll = poll
        self.tasks: dict[str, Task] = {}
        self.busy: dict[int, float] = {}  # node -> simulated time its late task ends
        self._seq = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def nodes(self) -> set[int]:
        return {t.node for t in self.tasks.values()}

    def free(self, node: int) -> bool:
        """Not holding a task, and (simulated) not still busy with a late one."""
        return self.busy.get(node, -1.0) <= self.clock.now()

    def push(self, messages: list[Message], base_version: int) -> None:
        ids = list(self.grid.push_messages(messages))
        pushed = time.monotonic()
        for msg_id, msg in zip(ids, messages, strict=False):
            node = msg.metadata.dst_node_id
            self._seq += 1
            task = Task(msg_id, node, base_version, self._seq, pushed)
            out = self.clock.outcome(node)
            if out is not None:
                task.end = out.end
                if out.lost:
                    task.fate, task.reason = "lost", (
                        f"offline: client went offline {out.duration:.4g} s into its task "
                        "(simulated)")
                elif out.duration > self.deadline:
                    task.fate, task.end = "late", out.start + self.deadline
                    task.reason = (f"late: needs {out.duration:.4g} s, deadline "
                                   f"{self.deadline:g} s (simulated)")
                    self.busy[node] = out.end
            self.tasks[msg_id] = task

    def next_events(self) -> list[Event]:
        """The next settled tasks (all those of the earliest instant when simulated)."""
        if not self.tasks:
            return []
        if self.clock.simulated:
            return self._next_simulated()
        return self._next_wall()

    def _next_simulated(self) -> list[Event]:
        t = min(task.end for task in self.tasks.values() if task.end is not None)
        batch = sorted((task for task in self.tasks.values() if task.end == t),
                       key=lambda task: (task.node, task.seq))
        replies = self._pull([task.msg_id for task in batch])
        self.clock.advance_to(t)
        events = []
        for task in batch:
            del self.tasks[task.msg_id]
            reply = replies.get(task.msg_id)
            if task.fate != "reply":  # its reply, if any, is discarded
                events.append(Event(task, t, None, task.reason,
                                    payload_bytes(reply) if reply is not None else 0))
            elif reply is None:
                events.append(Event(task, t, None,
                                    f"late: no reply within {self.wall_limit:g} s"))
            else:
                events.append(Event(task, t, reply, nbytes=payload_bytes(reply)))
        return events

    def _pull(self, ids: list[str]) -> dict[str, Message]:
        got: dict[str, Message] = {}
        collect(self.grid, ids, timeout=self.wall_limit, poll=self.poll,
                on_reply=got.__setitem__)
        return got

    def _next_wall(self) -> list[Event]:
        while True:
            arrived = {r.metadata.reply_to_message_id: r
                       for r in self.grid.pull_messages(list(self.tasks))}
            now, mono = self.clock.now(), time.monotonic()
            events = []
            for task in sorted(self.tasks.values(), key=lambda task: task.seq):
                if task.msg_id in arrived:
                    reply = arrived[task.msg_id]
                    events.append(Event(task, now, reply, nbytes=payload_bytes(reply)))
                elif mono - task.pushed_at > self.deadline:
                    events.append(Event(task, now, None,
                                        f"late: no reply within {self.deadline:g} s"))
            for ev in events:
                del self.tasks[ev.task.msg_id]
            if events:
                return events
            time.sleep(self.poll)


class Buffer:
    """Updates in, one aggregate out: the plain buffer sums them in the clear.

    Its secure counterpart is ``server.secure_buffer.SecureBuffer``, with the same
    ``full``, ``members``, ``total_weight`` and ``count``.
    """

    def __init__(self, pipeline: Pipeline, *, dim: int, version: int, size: int,
                 rescale: bool = True) -> None:
        self.agg = pipeline.open_round(dim=dim, version=version)
        self.size = size
        self.rescale = rescale
        self.version = version
        self.members: set[str] = set()
        self.base_total = 0.0  # sum of weights before staleness scaling
        weight = _weight_stage(pipeline)
        self._by_examples = weight is None or weight.by == "examples"

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


def _weight_stage(pipeline: Pipeline) -> Weight | None:
    return next((s for s in pipeline.update_stages if isinstance(s, Weight)), None)


class AsyncDriver(SyncDriver):
    """FedBuff: apply an aggregate every ``buffer_size`` accepted updates."""

    mixing = False

    def __init__(self, grid: Grid, *, config: dict[str, Any], task: ServerTask,
                 pipeline: Pipeline, store: Store, reporter: Reporter,
                 dp: DPController | None = None, clock: Clock | None = None) -> None:
        super().__init__(grid, config=config, task=task, pipeline=pipeline, store=store,
                         reporter=reporter, dp=dp, clock=clock)
        if dp is not None:
            raise ValueError("differential privacy accounting assumes synchronous rounds; "
                             f"driver.kind '{self.driver.kind}' cannot run with [dp]")
        self.size = 1 if self.mixing else self.driver.buffer_size
        weight = _weight_stage(pipeline)
        self.staleness_fn = weight.staleness if weight is not None else (lambda tau: 1.0)
        self.inflight = InFlight(self.grid, self.clock,  # the byte-counting grid
                                 deadline=self.driver.deadline(self.fed.round_timeout_s),
                                 wall_limit=self.fed.round_timeout_s, poll=self.fed.poll_s)
        self._ready: deque[Event] = deque()
        self._rng = np.random.default_rng([self.seed, 0xA5])
        self._bases: dict[int, np.ndarray] = {}  # model versions that tasks started from
        self._buffer: Buffer | SecureBuffer | None = None
        validate = next((s for s in pipeline.update_stages if isinstance(s, Validate)), None)
        self.max_staleness = validate.max_staleness if validate is not None else None
        self._records: list[UpdateRecord] = []
        self._losses: list[tuple[float, float]] = []
        self._staleness: list[int] = []
        self._run_id = ""  # the run being driven (names the compression of its tasks)
        self._bytes_up = 0  # payload of the replies processed since the last aggregate

    # ---- handing out tasks

    def _dispatch(self, nodes: list[int]) -> None:
        """Fill free concurrency slots with clients that are online and idle."""
        state, buffer = self.state, self._buffer
        limit = self.driver.concurrency_for(self.fed.clients_per_round(len(nodes)))
        busy = self.inflight.nodes()
        members = buffer.members if buffer is not None else set()
        candidates = [n for n in nodes if n not in busy and str(n) not in members
                      and self.inflight.free(n) and self.clock.online(n)]
        count = min(limit - len(self.inflight), len(candidates))
        if count <= 0:
            return
        picks = self._rng.choice(len(candidates), size=count, replace=False)
        chosen = sorted(candidates[int(i)] for i in picks)
        if state.version not in self._bases:
            self._bases[state.version] = state.params.copy()
        config = ConfigRecord({"server-round": state.version + 1,
                               wire.VERSION_KEY: state.version, wire.REPLY_KEY: "delta",
                               wire.TASK_KEY: self.task_json, wire.SEED_KEY: self.seed})
        if self.compression is not None:  # compressed uploads, decoded per task in _process
            config[COMPRESSION_KEY] = self.compression.request(self._run_id)
        content = RecordDict({"arrays": wire.model_record(self.layout, state.params),
                              "config": config})
        kind = "train" if self.secure is None else f"train.{secure_client.HOLD_ACTION}"
        self.inflight.push([Message(content, node, kind, group_id=str(state.version))
                            for node in chosen], state.version)

    def _wait(self, nodes: list[int], since: float) -> list[int]:
        """Nothing in flight and no client to give work to: wait until one can take it.

        Returns the node ids to use next (the Grid's, refreshed, on the wall clock).
        """
        if not self.clock.simulated:
            if time.monotonic() - since > self.fed.wait_for_nodes_s:
                raise RuntimeError(f"no client could take a task for "
                                   f"{self.fed.wait_for_nodes_s:g} s")
            time.sleep(self.fed.poll_s)
            return list(self.grid.get_node_ids())
        now = self.clock.now()
        members = self._buffer.members if self._buffer is not None else set()
        times = [t for n in nodes if str(n) not in members
                 for t in (self.inflight.busy.get(n, now), self.clock.next_online(n))
                 if t > now]
        if not times:
            raise RuntimeError(f"no client can take a task: the {len(members)} idle clients "
                               f"are all in the buffer of {self.size}")
        self.clock.advance_to(min(times))
        return nodes

    # ---- processing replies

    def _process(self, ev: Event, rnd: int) -> None:
        task, buffer = ev.task, self._buffer
        assert buffer is not None
        self._bytes_up += ev.nbytes
        client_id = str(task.node)
        if ev.reply is None:
            self._records.append(UpdateRecord(client_id=client_id, fate="dropped",
                                              reason=ev.reason, base_version=task.base_version,
                                              staleness=self.state.version - task.base_version))
            return
        if isinstance(buffer, SecureBuffer):
            self._offer(buffer, ev, rnd)
            return
        try:
            sender = ev.reply.metadata.src_node_id
            if sender != task.node:
                raise wire.WireError(f"reply to the message sent to node {task.node} says it "
                                     f"comes from node {sender}")
            codec = None if self.compression is None else self.compression.codec(
                self._run_id, task.base_version + 1, self.layout.dim)  # its "server-round"
            update = decode_train_reply(ev.reply, client_id=client_id, layout=self.layout,
                                        base_params=self._bases[task.base_version],
                                        version=task.base_version, codec=codec)
        except wire.WireError as exc:
            self._records.append(_record(buffer.reject(client_id, str(exc))))
            self.reporter.message(f"version {self.state.version}: rejected client "
                                  f"{client_id}: {exc}")
            return
        verdict = buffer.submit(update)
        if verdict.accepted:
            self._staleness.append(int(verdict.staleness or 0))
            if "train_loss" in update.metrics:
                self._losses.append((update.metrics["train_loss"], float(update.num_examples)))
            self.reporter.client_done(rnd, buffer.agg.num_accepted, self.size)
        else:
            self.reporter.message(f"version {self.state.version}: rejected client {client_id}: "
                                  f"{verdict.reason}")
        self._records.append(_record(verdict, update.metrics))

    def _offer(self, buffer: SecureBuffer, ev: Event, rnd: int) -> None:
        """Secure FedBuff: a ready client joins the buffer; its update stays with it."""
        task = ev.task
        assert ev.reply is not None
        record = buffer.offer(task.node, task.base_version, ev.reply)
        if record is None:
            self._staleness.append(self.state.version - task.base_version)
            self.reporter.client_done(rnd, len(buffer.ready), self.size)
            return
        self._records.append(record)
        self.reporter.message(f"version {self.state.version}: rejected client {task.node}: "
                              f"{record.reason}")

    def _secure_step(self, buffer: SecureBuffer, run_id: str, rnd: int) -> np.ndarray | None:
        """Secure FedBuff: the buffer's secure sum as FedBuff's aggregate (None: aborted)."""
        before = self.grid.up
        step = buffer.finish(self.grid, dim=self.layout.dim, session=session_id(run_id),
                             rnd=rnd, timeout=self.fed.round_timeout_s, poll=self.fed.poll_s,
                             sparse=self.secure.pattern(run_id, rnd, self.layout.dim))
        self._bytes_up += self.grid.up - before  # the secure stages' replies
        self._records += buffer.records()
        if step is None:
            outcome = buffer.outcome
            why = outcome.abort_reason if outcome is not None else None
            self.reporter.message(f"round {rnd}: secure aggregation of the buffer failed: "
                                  f"{why or 'no weight'}; the model is unchanged")
        return step

    def _open_buffer(self) -> Buffer | SecureBuffer:
        version = self.state.version
        if self.secure is not None:
            return SecureBuffer(self.secure, version=version, size=self.size,
                                staleness=self.staleness_fn, max_staleness=self.max_staleness)
        return Buffer(self.pipeline, dim=self.layout.dim, version=version, size=self.size,
                      rescale=not self.mixing)

    def _step(self, buffer: Buffer) -> np.ndarray | None:
        """The step to apply: the buffer's aggregate, or FedAsync's mixing step."""
        delta = buffer.finish()
        if delta is None or not self.mixing:
            return delta
        verdict = next(v for v in buffer.agg.verdicts if v.accepted)
        tau = int(verdict.staleness or 0)
        mix = self.driver.alpha * self.staleness_fn(tau)
        # (1 - a) w + a (w_base + delta)  ==  w + a (w_base - w + delta)
        step = self._bases[int(verdict.base_version or 0)] - self.state.params
        step += delta
        step *= np.float32(mix)
        return step

    def run_round(self, run_id: str, rnd: int) -> dict[str, float]:
        """Process replies until one aggregate is applied; record it as round ``rnd``."""
        t0 = time.perf_counter()
        state = self.state
        self._run_id = run_id
        nodes = wait_for_nodes(self.grid, self.fed)
        self.clock.bind(nodes)
        self._resume_clock()
        if self._buffer is None:
            self._buffer = self._open_buffer()
            self.reporter.round_started(rnd, self.size)
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

        if isinstance(buffer, SecureBuffer):
            step = self._secure_step(buffer, run_id, rnd)
        else:
            try:
                step = self._step(buffer)
            except ValueError as exc:  # e.g. a robust combine refusing the buffer
                self.reporter.message(f"round {rnd}: aggregation failed: {exc}")
                step = None
        state.params = self.pipeline.apply(state.params, step, total_weight=buffer.total_weight,
                                           count=buffer.count)
        if step is not None:
            state.version += 1
        state.round = rnd
        self._buffer = None
        self._prune_bases()
        metrics = {k: float(v) for k, v in self.task.evaluate(state.params).items()}
        if self.clock.simulated:
            metrics["sim_time_s"] = self.clock.now()
        if self._staleness:
            metrics["staleness_mean"] = float(np.mean(self._staleness))
        metrics.update(self._traffic())
        if self._losses:
            metrics["train_loss"] = float(np.average([loss for loss, _ in self._losses],
                                                     weights=[w for _, w in self._losses]))
        records = self._records
        counts = {fate: sum(r.fate == fate for r in records)
                  for fate in ("accepted", "rejected", "dropped")}
        secure = buffer if isinstance(buffer, SecureBuffer) else None
        status = ("completed" if step is not None else
                  "aborted" if secure is not None and secure.aborted else "failed")
        self.store.record_round(run_id, round=rnd, model_version=state.version, status=status,
                                num_sampled=len(records),
                                num_replies=len(records) - counts["dropped"],
                                num_accepted=counts["accepted"],
                                num_rejected=counts["rejected"], num_dropped=counts["dropped"],
                                metrics=metrics, wall_s=time.perf_counter() - t0,
                                updates=records)
        if secure is not None:
            secure.save(self.store, run_id, rnd)
        self._records, self._losses, self._staleness = [], [], []
        state.history.append(metrics)
        if self.fed.checkpoint_every and (rnd % self.fed.checkpoint_every == 0
                                          or rnd == self.fed.rounds):
            self.store.save_checkpoint(run_id, round=rnd, model_version=state.version,
                                       params=state.params,
                                       state={"pipeline": self.pipeline.state_dict()})
        self.reporter.round_finished(rnd, {**metrics, **{k: float(v)
                                                         for k, v in counts.items()}})
        return metrics

    def _traffic(self) -> dict[str, float]:
        """Bytes of this aggregate: the replies it processed (each counted in the round
        that handles it) and the tasks pushed since the previous aggregate."""
        down = self.grid.since_last()["bytes_down"]
        up, self._bytes_up = self._bytes_up, 0
        return {"bytes_up": float(up), "bytes_down": down}

    def _prune_bases(self) -> None:
        keep = {t.base_version for t in self.inflight.tasks.values()}
        keep |= {ev.task.base_version for ev in self._ready}
        for version in [v for v in self._bases if v not in keep]:
            del self._bases[version]

    def _finish_extras(self, run_id: str, summary: dict[str, Any]) -> None:
        """Record what arrived after the last applied aggregate as an aborted round."""
        version = self.state.version
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
            last = self.state.history[-1] if self.state.history else {}
            self._bytes_up += sum(ev.nbytes for ev in self._ready)
            self.store.record_round(run_id, round=self.state.round + 1, model_version=version,
                                    status="aborted", num_sampled=len(records),
                                    num_replies=replies,
                                    num_rejected=sum(r.fate == "rejected" for r in records),
                                    num_dropped=sum(r.fate == "dropped" for r in records),
                                    metrics={**last, **self._traffic()}, updates=records)
        self._records, self._ready = [], deque()
        super()._finish_extras(run_id, summary)
        summary["buffer_size"] = self.size


class FedAsyncDriver(AsyncDriver):
    """FedAsync: every accepted update is mixed in at once with weight alpha * s(tau)."""

    mixing = True


def async_driver_class(kind: str) -> type[AsyncDriver]:
    """The driver class for ``driver.kind`` 'fedasync' or 'fedbuff'."""
    kinds = {"fedasync": FedAsyncDriver, "fedbuff": AsyncDriver}
    if kind not in kinds:
        raise ValueError(f"unknown async driver '{kind}'; choose one of: {', '.join(kinds)}")
    return kinds[kind]
