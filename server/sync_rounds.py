"""Synchronous rounds: draw a cohort, send it the model, collect, aggregate.

:class:`SyncRounds` is the round source of ``driver.kind = "sync"``: it draws each round's
cohort among the eligible nodes and hands it to a collector, which runs the round up to
its ``RoundResult``: :class:`PlainReplies` (each client's update, with a deadline; late
updates dropped or carried as stale) or ``server.secure_sync.SecureSum`` (SecAgg+: the
server learns only the sum).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from flwr.app import Message, RecordDict

from client.protocol.errors import WireError
from server.cohort import draw_cohort
from server.compression import ReplyCompression
from server.grid_io import push_and_collect_in_order
from server.replies import decode_train_reply
from server.rounds import RoundResult, RoundSource, RunContext, mean_loss, update_record
from server.settle import settle, unreachable
from server.store import UpdateRecord

if TYPE_CHECKING:
    from aggregation.update import Update


class Collector:
    """Runs one synchronous round with a given cohort, up to its result."""

    @contextmanager
    def session(self) -> Iterator[None]:
        """A context for the whole run; checks at start."""
        yield

    def carried(self) -> set[int]:
        """Nodes whose late reply is still awaited (not to be sampled)."""
        return set()

    def busy_until(self, node: int, now: float) -> float:
        """When ``node``'s late task from an earlier round ends (simulated clock)."""
        return now

    def busy(self) -> bool:
        """Whether any node may still be busy with a late task (see :meth:`busy_until`)."""
        return False

    def collect(self, run_id: str, rnd: int, cohort: list[int]) -> RoundResult:
        raise NotImplementedError


class SyncRounds(RoundSource):
    """Rounds of a cohort drawn among the online, idle nodes, run by ``collector``."""

    def __init__(self, ctx: RunContext, collector: Collector) -> None:
        self.ctx = ctx
        self.collector = collector

    @contextmanager
    def session(self) -> Iterator[None]:
        with self.collector.session():
            yield

    def next_round(self, run_id: str, rnd: int) -> RoundResult:
        cohort = self._sample(rnd)
        self.ctx.reporter.round_started(rnd, len(cohort))
        return self.collector.collect(run_id, rnd, cohort)

    def _sample(self, rnd: int) -> list[int]:
        """The round's clients among those online and not still busy with a late task."""
        ctx = self.ctx
        clock = ctx.clock
        nodes = ctx.wait_for_nodes()
        clock.bind(nodes)
        ctx.resume_clock()
        carried, busy_until = self.collector.carried(), self.collector.busy_until
        if clock.all_online() and not carried and not self.collector.busy():
            # every node is online and idle: draw among all, never listing them
            return draw_cohort(nodes, fed=ctx.fed, concurrency=ctx.driver_config.concurrency,
                               seed=ctx.seed, rnd=rnd, dp=ctx.dp)
        while True:
            now = clock.now()
            eligible = [n for n in nodes if n not in carried and busy_until(n, now) <= now
                        and clock.online(n)]
            if eligible or not clock.simulated:
                break
            waiting = [t for n in nodes if n not in carried
                       for t in (busy_until(n, now), clock.next_online(n)) if t > now]
            if not waiting:
                raise RuntimeError("no client can ever take part: every one is busy with a "
                                   "carried late update")
            clock.advance_to(min(waiting))
        population = eligible or nodes
        if ctx.dp is not None and len(population) < len(nodes):
            raise RuntimeError(
                f"round {rnd}: only {len(population)} of {len(nodes)} clients could be "
                "sampled (the others are busy with a late task or offline); with [dp] who can "
                "be sampled must not depend on earlier cohorts, which the privacy accountant "
                "assumes: set driver.deadline_s = 0 (or longer than any client's task) and "
                "clients.offline_fraction = 0, or dp.mode = 'off'")
        return draw_cohort(population, fed=ctx.fed, concurrency=ctx.driver_config.concurrency,
                           seed=ctx.seed, rnd=rnd, dp=ctx.dp)


class PlainReplies(Collector):
    """Each client of the cohort trains and replies with its update; the pipeline combines.

    Replies are consumed in push order until the deadline. Late updates are dropped
    (recorded) or, with ``late_policy = "carry"``, consumed by the first round still open
    when they arrive, as stale updates. On a simulated clock the replies are computed at
    once and their arrival times come from the clock; the round lasts until the slowest
    on-time reply, or the deadline when a client is late or went offline.
    """

    def __init__(self, ctx: RunContext, compression: ReplyCompression | None) -> None:
        self.ctx = ctx
        self.compression = compression  # None: dense uploads
        self._busy: dict[int, float] = {}  # node -> simulated time its late task ends
        self._carried: list[tuple[float, int, Message]] = []  # late replies (simulated)
        self._late: dict[str, tuple[int, float]] = {}  # late message id -> (node, pushed at)
        self._sent: dict[str, tuple[int, int]] = {}  # unsettled message id -> (node, version)

    def carried(self) -> set[int]:
        return {node for _, node, _ in self._carried} | {n for n, _ in self._late.values()}

    def busy_until(self, node: int, now: float) -> float:
        return self._busy.get(node, now)

    def busy(self) -> bool:
        return bool(self._busy)

    def collect(self, run_id: str, rnd: int, cohort: list[int]) -> RoundResult:
        ctx = self.ctx
        state, layout = ctx.state, ctx.layout
        codec, request = None, None
        if self.compression is not None:  # the clients upload compressed deltas
            request = self.compression.request(run_id)
            codec = self.compression.codec(run_id, rnd, layout.dim)
        config = ctx.train_config(rnd, compression=request)
        content = RecordDict({"arrays": ctx.model_record(), "config": config})
        messages = [Message(content, node, "train", group_id=str(rnd)) for node in cohort]
        agg = ctx.pipeline.open_round(dim=layout.dim, version=state.version)
        records: list[UpdateRecord] = []
        losses: list[tuple[float, float]] = []
        rewrite = ctx.pipeline.pre_combine  # None: each update goes in as it arrives
        held: list[Update] = []
        done = lost = 0  # replies; the SuperLink's replies for nodes that are gone

        def submit(update: Update) -> None:
            verdict = agg.submit(update)
            if not verdict.accepted:
                ctx.reporter.message(f"round {rnd}: rejected client {update.client_id}: "
                                     f"{verdict.reason}")
            elif "train_loss" in update.metrics:
                losses.append((update.metrics["train_loss"], float(update.num_examples)))
            records.append(update_record(verdict, update.metrics))

        def consume(reply: Message) -> None:
            nonlocal done, lost
            done += 1
            ctx.reporter.client_done(rnd, done, len(cohort))
            client_id, version, problem = self._settle(reply)
            gone = None if problem is not None else unreachable(reply, int(client_id))
            if gone is not None:  # the SuperLink's word: the node is gone
                lost += 1
                ctx.reporter.message(f"round {rnd}: dropped client {client_id}: {gone}")
                records.append(UpdateRecord(client_id=client_id, fate="dropped", reason=gone))
                return
            try:
                if problem is not None:
                    raise WireError(problem)
                update = decode_train_reply(reply, client_id=client_id, layout=layout,
                                            base_params=state.params, version=version,
                                            codec=codec)
            except WireError as exc:
                verdict = agg.reject(client_id, str(exc))
                ctx.reporter.message(f"round {rnd}: rejected client {client_id}: {exc}")
                records.append(update_record(verdict))
                return
            if rewrite is not None:
                held.append(update)
            else:
                submit(update)

        num_replies, missing = self._collect(messages, consume, records)
        num_replies -= lost
        for update in rewrite(held) if rewrite is not None else ():
            submit(update)
        self._forget_settled()
        note = (f"no update was accepted ({num_replies} replies, {len(missing)} missing)")
        try:
            delta = agg.finish()
        except ValueError as exc:  # e.g. a robust combine left with too few updates
            delta, note = None, f"aggregation failed: {exc}"
        return RoundResult(aggregate=delta, status="completed" if delta is not None else "failed",
                           records=records, num_sampled=len(cohort), num_replies=num_replies,
                           total_weight=agg.total_weight, count=agg.num_accepted,
                           metrics=mean_loss(losses), note=note)

    # ---- who answered: each reply must settle a message sent to that node

    def _remember(self, pushed: dict[str, int]) -> None:
        self._sent.update({i: (node, self.ctx.state.version) for i, node in pushed.items()})

    def _settle(self, reply: Message) -> tuple[str, int, str | None]:
        """The client a reply answers for, the model version it was sent, and why the
        reply cannot be that client's answer (None when it can)."""
        return settle(self._sent, reply, self.ctx.state.version)

    def _forget_settled(self) -> None:
        """Keep only the sent messages whose replies may still come (late, carried)."""
        open_ids = set(self._late) | {r.metadata.reply_to_message_id for _, _, r in self._carried}
        self._sent = {i: sent for i, sent in self._sent.items() if i in open_ids}

    # ---- stragglers: deadline and late policy

    def _collect(self, messages: list[Message], consume: Callable[[Message], None],
                 records: list[UpdateRecord]) -> tuple[int, list[int]]:
        """Push, wait up to the deadline and hand on-time replies to ``consume``; returns
        (replies, dropped node ids)."""
        deadline = self.ctx.driver_config.deadline(self.ctx.fed.round_timeout_s)
        carry = self.ctx.driver_config.late_policy == "carry"
        if not self.ctx.clock.simulated:
            pending: dict[str, int] = {}
            received, missing = push_and_collect_in_order(
                self.ctx.grid, messages, timeout=deadline, poll=self.ctx.fed.poll_s,
                on_reply=consume, pending_out=pending, on_push=self._remember)
            received += self._consume_late(consume, records)
            if carry:
                pushed = time.monotonic()
                self._late.update({i: (node, pushed) for i, node in pending.items()})
                missing = [n for n in missing if n not in set(pending.values())]
            records += [UpdateRecord(client_id=str(node), fate="dropped",
                                     reason=f"late: no reply within {deadline:g} s")
                        for node in missing]
            return received, missing

        t0 = self.ctx.clock.now()
        outcomes = {m.metadata.dst_node_id: self.ctx.clock.outcome(m.metadata.dst_node_id)
                    for m in messages}
        dropped: list[int] = []
        ends = [t0]

        def route(reply: Message) -> None:
            sent = self._sent.get(reply.metadata.reply_to_message_id)
            node = sent[0] if sent is not None else reply.metadata.src_node_id
            out = outcomes.get(node)
            if out is None:
                consume(reply)
            elif out.lost:
                dropped.append(node)
                records.append(UpdateRecord(
                    client_id=str(node), fate="dropped",
                    reason=f"offline: client went offline {out.duration:.4g} s into its "
                           "task (simulated)"))
            elif out.duration > deadline:
                self._busy[node] = out.end
                if carry:
                    self._carried.append((out.end, node, reply))
                    return
                dropped.append(node)
                records.append(UpdateRecord(
                    client_id=str(node), fate="dropped",
                    reason=f"late: needs {out.duration:.4g} s, deadline {deadline:g} s "
                           "(simulated)"))
            else:
                ends.append(out.end)
                consume(reply)

        received, missing = push_and_collect_in_order(
            self.ctx.grid, messages, timeout=self.ctx.fed.round_timeout_s,
            poll=self.ctx.fed.poll_s, on_reply=route, on_push=self._remember)
        records += [UpdateRecord(client_id=str(node), fate="dropped",
                                 reason=f"late: no reply within {self.ctx.fed.round_timeout_s:g} s")
                    for node in missing]
        on_time = all(not o.lost and o.duration <= deadline for o in outcomes.values())
        end = max(ends) if on_time and not missing else t0 + deadline
        self.ctx.clock.advance_to(end)
        arrived = sorted((c for c in self._carried if c[0] <= end), key=lambda c: c[:2])
        self._carried = [c for c in self._carried if c[0] > end]
        for _, _, reply in arrived:  # stale updates from earlier rounds, in arrival order
            consume(reply)
        return received, dropped + missing

    def _consume_late(self, consume: Callable[[Message], None],
                      records: list[UpdateRecord]) -> int:
        """Wall clock, ``carry``: pull earlier rounds' late replies into this round."""
        if not self._late:
            return 0
        arrived = {r.metadata.reply_to_message_id: r
                   for r in self.ctx.grid.pull_messages(list(self._late))}
        order = list(self._late)
        for msg_id in order:
            if msg_id in arrived:
                del self._late[msg_id]
                consume(arrived[msg_id])
        expired = [i for i in order if i in self._late
                   and time.monotonic() - self._late[i][1] > self.ctx.fed.round_timeout_s]
        for msg_id in expired:
            node, _ = self._late.pop(msg_id)
            records.append(UpdateRecord(
                client_id=str(node), fate="dropped",
                reason=f"late: no reply within {self.ctx.fed.round_timeout_s:g} s"))
        return sum(i in arrived for i in order)
