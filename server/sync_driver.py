"""The synchronous round driver: sample, send the model, wait with a deadline, aggregate.

It talks to any ``flwr.serverapp.Grid`` (in-process, Flower simulation or a SuperLink)
through push/pull messages, and records every round and every update in the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from aggregation import Layout, Pipeline, Verdict
from client import wire
from client.compression import COMPRESSION_KEY
from server.clock import Clock, WallClock
from server.compression import ReplyCompression
from server.config import FederationConfig
from server.dp import DPController
from server.driver_config import DriverConfig
from server.exchange import collect, push
from server.replies import decode_train_reply
from server.reporter import Reporter
from server.store import Store, UpdateRecord
from server.task import ServerTask
from server.wire_bytes import ByteCountingGrid


@dataclass
class RunState:
    """Everything that changes from round to round (what a checkpoint holds)."""

    params: np.ndarray
    version: int = 0
    round: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def cohort_rng(seed: int, rnd: int, *, secret: bool, stream: int = 0) -> np.random.Generator:
    """The generator that draws round ``rnd``'s cohort: from operating-system entropy when
    the draw must stay secret (DP claiming amplification by sampling, see ``server.dp``),
    else from (seed, round, stream), so that a simulation replays its cohorts."""
    if secret:
        return np.random.default_rng()
    return np.random.default_rng([seed, rnd] + ([stream] if stream else []))


def sample_nodes(node_ids: Iterable[int], fed: FederationConfig,
                 rng: np.random.Generator) -> list[int]:
    """Nodes taking part in a round, drawn from ``node_ids`` with ``rng``
    (see :func:`cohort_rng`)."""
    available = sorted(node_ids)
    if fed.sampling == "poisson":
        return [n for n, pick in zip(available, rng.random(len(available)) < fed.sample_fraction,
                                     strict=True) if pick]
    k = fed.clients_per_round(len(available))
    # Sample positions, not ids: Flower's node ids are uint64 and numpy would round them.
    return sorted(available[int(i)] for i in rng.choice(len(available), size=k, replace=False))


def wait_for_nodes(grid: Grid, fed: FederationConfig) -> list[int]:
    """Connected node ids once at least ``min_clients`` are there (else a clear error)."""
    deadline = time.monotonic() + fed.wait_for_nodes_s
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= fed.min_clients:
            return nodes
        if time.monotonic() >= deadline:
            raise RuntimeError(f"only {len(nodes)} node(s) connected after "
                               f"{fed.wait_for_nodes_s:.0f} s, federation.min_clients is "
                               f"{fed.min_clients}: start more SuperNodes or lower min_clients")
        time.sleep(fed.poll_s)


def exchange(grid: Grid, messages: list[Message], *, timeout: float, poll: float,
             on_reply: Callable[[Message], None],
             pending_out: dict[str, int] | None = None,
             on_push: Callable[[dict[str, int]], None] | None = None) -> tuple[int, list[int]]:
    """Push messages and hand each reply to ``on_reply`` as soon as it can be consumed.

    Replies are consumed in push order (a reply that arrives early waits for the ones
    before it), so the aggregate does not depend on arrival order; on the in-process
    engine they arrive in that order and nothing waits. Each reply is dropped once
    consumed, so the server holds at most the out-of-order ones. Returns the number of
    replies and the destination node ids that did not answer before the deadline (their
    message ids go to ``pending_out`` when given, to pull the replies later).
    ``on_push`` gets {message id: destination node} once the messages are pushed. A reply
    to no pending message (a duplicate or a replay) goes to ``on_reply`` at once, to be
    rejected there, and does not count.
    """
    nodes_by_id = push(grid, messages)
    if on_push is not None:
        on_push(nodes_by_id)
    pushed = set(nodes_by_id.values())
    missing = [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in pushed]
    position = {msg_id: i for i, msg_id in enumerate(nodes_by_id)}
    waiting: dict[int, Message] = {}
    next_pos = 0

    def in_push_order(msg_id: str, reply: Message) -> None:
        nonlocal next_pos
        waiting[position[msg_id]] = reply
        while next_pos in waiting:
            on_reply(waiting.pop(next_pos))
            next_pos += 1

    # A reply to no pending message (a duplicate, or a reply to another round) is rejected.
    late = collect(grid, nodes_by_id, timeout=timeout, poll=poll, on_reply=in_push_order,
                   on_stray=on_reply)
    for pos in sorted(waiting):  # the deadline passed with gaps: consume the rest in order
        on_reply(waiting.pop(pos))
    if pending_out is not None:
        pending_out.update({i: nodes_by_id[i] for i in late})
    return len(nodes_by_id) - len(late), missing + [nodes_by_id[i] for i in late]


def _record(verdict: Verdict, metrics: dict[str, float] | None = None) -> UpdateRecord:
    return UpdateRecord(client_id=verdict.client_id,
                        fate="accepted" if verdict.accepted else "rejected",
                        reason=verdict.reason, num_examples=verdict.num_examples,
                        base_version=verdict.base_version, staleness=verdict.staleness,
                        norm=verdict.norm, weight=verdict.weight, metrics=metrics or {})


class SyncDriver:
    """Runs rounds of synchronous federated training over a Grid."""

    secure: Any = None  # a server.secure_round.SecureRounds when [secagg] is enabled
    audit: Any = None  # a server.audit.CanaryAudit (a pipeline stage) with [audit] canaries

    def __init__(self, grid: Grid, *, config: dict[str, Any], task: ServerTask,
                 pipeline: Pipeline, store: Store, reporter: Reporter,
                 dp: DPController | None = None, clock: Clock | None = None) -> None:
        self.grid = ByteCountingGrid(grid)  # bytes on the wire, per round and per run
        self.config = config
        self.compression = ReplyCompression.from_config(config)  # None: dense uploads
        self.fed: FederationConfig = FederationConfig(**config["federation"])
        self.seed = int(config["seed"])
        self.task = task
        self.pipeline = pipeline
        self.store = store
        self.reporter = reporter
        self.dp = dp
        self.stop_reason: str | None = None
        self.driver = DriverConfig(**config.get("driver", {}))
        self.clock: Clock = clock or WallClock()
        self._busy: dict[int, float] = {}  # node -> simulated time its late task ends
        self._carried: list[tuple[float, int, Message]] = []  # late replies (simulated)
        self._late: dict[str, tuple[int, float]] = {}  # late message id -> (node, pushed at)
        self._sent: dict[str, tuple[int, int]] = {}  # unsettled message id -> (node, version)
        params, layout = task.initial_params()
        self.layout: Layout = layout
        self.state = RunState(params=params)
        self.task_json = json.dumps(task.task_spec(), sort_keys=True)

    def run(self, run_id: str | None = None) -> dict[str, Any]:
        """Train for the configured rounds; returns the run summary."""
        started = time.perf_counter()
        if self.secure is not None:  # e.g. distributed DP's wrap check against [secagg] bits
            self.secure.prepare(self)
        if run_id is None:
            run_id = self.store.create_run(config=self.config, seed=self.seed,
                                           name=self.config.get("name"))
            self._evaluate_and_record(run_id, rnd=0, wall_s=0.0)
        self.reporter.run_started(run_id, self.config)
        try:
            while (self.state.round < self.fed.rounds and not self._budget_stop()
                   and not self._target_reached()):
                self.run_round(run_id, self.state.round + 1)
            self.store.flush()  # the last checkpoint is written off the round's path
        except BaseException:
            self.store.finish_run(run_id, status="failed")
            raise
        last = self.state.history[-1] if self.state.history else {}
        status = ("stopped" if self.stop_reason else
                  "completed" if self.state.version > 0 else "failed")
        summary = {"run_id": run_id, "status": status, "rounds": self.state.round,
                   "versions": self.state.version,
                   "final_accuracy": last.get("accuracy"), "final_loss": last.get("loss"),
                   "wall_s": round(time.perf_counter() - started, 3),
                   "store": self.store.display_url()}
        if self.dp is not None:
            summary.update(self.dp.summary())
        if self.audit is not None:  # the one-shot estimate from theta_T - theta_0
            initial, _ = self.task.initial_params()
            summary.update(self.audit.summary(self.state.params - initial))
        if self.stop_reason:
            summary["stop_reason"] = self.stop_reason
        if self.grid.down:  # this process's traffic (a driver that used the counting grid)
            summary.update(self.grid.totals())
        self._finish_extras(run_id, summary)
        self.store.finish_run(run_id, status=status, summary=summary)
        self.reporter.run_finished(summary)
        return summary

    def resume(self, run_id: str) -> dict[str, Any]:
        """Continue ``run_id`` from its last checkpoint: model, version, pipeline and privacy
        state. Rounds recorded after that checkpoint are discarded and run again, so no round
        is lost or applied twice; sampling and client seeds derive from (seed, round), so the
        result equals an uninterrupted run's (up to DP noise, which is never replayable, and
        cohorts under DP without ``dp.reproducible_cohorts``, which are drawn in secret)."""
        ckpt = self.store.load_checkpoint(run_id)
        if ckpt is None:
            raise ValueError(f"run {run_id} has no checkpoint to resume from (it needs "
                             "federation.checkpoint_every >= 1)")
        if ckpt.params.shape != self.state.params.shape:
            raise ValueError(f"run {run_id}'s checkpoint has {ckpt.params.size} parameters, "
                             f"the model has {self.state.params.size}")
        self.state.params = np.array(ckpt.params, dtype=np.float32)
        self.state.version = ckpt.model_version
        self.state.round = ckpt.round
        self.pipeline.load_state_dict(ckpt.state.get("pipeline", {}))
        if self.dp is not None:
            self.dp.load_state_dict(ckpt.state["dp"])
        self.state.history = [r.metrics for r in self.store.rounds(run_id)
                              if r.round <= ckpt.round]
        self.store.reopen_run(run_id, after_round=ckpt.round)
        self.reporter.message(f"resuming run {run_id} after round {ckpt.round} "
                              f"(model version {ckpt.model_version})")
        return self.run(run_id)

    def account_privacy(self, run_id: str, rnd: int, *, released: bool,
                        metrics: dict[str, float], noise_multiplier: float | None = None) -> None:
        """Charge a round to the accountant and the stored ledger (no-op without DP);
        ``noise_multiplier``: what this round's aggregate actually held, if not the plan's."""
        if self.dp is None:
            return
        spent = self.dp.end_round(released=released, noise_multiplier=noise_multiplier)
        self.store.record_privacy(run_id, round=rnd, mode=self.dp.config.mode,
                                  accountant=self.dp.config.accountant,
                                  epsilon=spent.epsilon, delta=spent.delta,
                                  noise_multiplier=spent.noise_multiplier, clip=spent.clip,
                                  sampling_rate=spent.sampling_rate,
                                  epsilon_model=spent.epsilon_model,
                                  protects_against=spent.protects_against)
        metrics.update(epsilon=spent.epsilon, clip=spent.clip)
        if spent.epsilon_model is not None:
            metrics["epsilon_model"] = spent.epsilon_model

    def _budget_stop(self) -> bool:
        """Stop before a round that would take the run past its epsilon budget."""
        if self.dp is None:
            return False
        after = self.dp.next_round_exceeds_budget()
        if after is None:
            return False
        return self._stop_before_next_round(
            f"epsilon would reach {after:.4g} > dp.epsilon_budget "
            f"{self.dp.config.epsilon_budget:g} (spent {self.dp.epsilon():.4g})")

    def _stop_before_next_round(self, why: str) -> bool:
        """Record and show why the run stops before its next round; True."""
        self.stop_reason = f"stopped before round {self.state.round + 1}: {why}"
        self.reporter.message(self.stop_reason)
        return True

    def _evaluate_and_record(self, run_id: str, *, rnd: int, wall_s: float) -> dict[str, float]:
        metrics = {k: float(v) for k, v in self.task.evaluate(self.state.params).items()}
        self.store.record_round(run_id, round=rnd, model_version=self.state.version,
                                metrics=metrics, wall_s=wall_s)
        self.state.history.append(metrics)
        return metrics

    def run_round(self, run_id: str, rnd: int) -> dict[str, float]:
        """One round: sample, send, collect, aggregate, evaluate, record, checkpoint."""
        t0 = time.perf_counter()
        state = self.state
        sampled = self._sample(rnd)
        self.reporter.round_started(rnd, len(sampled))
        if self.secure is not None:  # secure aggregation: the server only ever sees the sum
            return self.secure.run_round(self, run_id, rnd, sampled, t0)
        config = ConfigRecord({"server-round": rnd, wire.VERSION_KEY: state.version,
                               wire.REPLY_KEY: "delta", wire.TASK_KEY: self.task_json,
                               wire.SEED_KEY: self.seed})
        codec = None
        if self.compression is not None:  # the clients upload compressed deltas
            config[COMPRESSION_KEY] = self.compression.request(run_id)
            codec = self.compression.codec(run_id, rnd, self.layout.dim)
        content = RecordDict({"arrays": wire.model_record(self.layout, state.params),
                              "config": config})
        messages = [Message(content, node, "train", group_id=str(rnd)) for node in sampled]
        agg = self.pipeline.open_round(dim=self.layout.dim, version=state.version)
        records: list[UpdateRecord] = []
        losses: list[tuple[float, float]] = []

        def consume(reply: Message) -> None:
            self.reporter.client_done(rnd, len(records) + 1, len(sampled))
            client_id, version, problem = self._settle(reply)
            try:
                if problem is not None:
                    raise wire.WireError(problem)
                update = decode_train_reply(reply, client_id=client_id, layout=self.layout,
                                            base_params=state.params, version=version,
                                            codec=codec)
            except wire.WireError as exc:
                verdict = agg.reject(client_id, str(exc))
                self.reporter.message(f"round {rnd}: rejected client {client_id}: {exc}")
                records.append(_record(verdict))
                return
            verdict = agg.submit(update)
            if not verdict.accepted:
                self.reporter.message(f"round {rnd}: rejected client {client_id}: "
                                      f"{verdict.reason}")
            elif "train_loss" in update.metrics:
                losses.append((update.metrics["train_loss"], float(update.num_examples)))
            records.append(_record(verdict, update.metrics))

        num_replies, missing = self._collect(messages, consume, records)
        self._forget_settled()

        try:
            delta = agg.finish()
        except ValueError as exc:  # e.g. a robust combine left with too few updates
            self.reporter.message(f"round {rnd}: aggregation failed: {exc}")
            delta = None
        if self.audit is not None:  # sizes the canaries of a run without DP
            self.audit.observe_norms(v.norm for v in agg.verdicts if v.accepted)
        state.params = self.pipeline.apply(state.params, delta, total_weight=agg.total_weight,
                                           count=agg.num_accepted)
        if delta is not None:
            state.version += 1
        state.round = rnd
        metrics = {k: float(v) for k, v in self.task.evaluate(state.params).items()}
        if self.clock.simulated:
            metrics["sim_time_s"] = self.clock.now()
        metrics.update(self.grid.since_last())  # bytes_up, bytes_down
        self.account_privacy(run_id, rnd, released=delta is not None, metrics=metrics)
        if losses:
            metrics["train_loss"] = float(np.average([loss for loss, _ in losses],
                                                     weights=[w for _, w in losses]))
        wall = time.perf_counter() - t0
        num_rejected = sum(r.fate == "rejected" for r in records)
        status = "completed" if delta is not None else "failed"
        if delta is None:
            self.reporter.message(f"round {rnd}: no update was accepted ({num_replies} replies, "
                                  f"{len(missing)} missing); the model is unchanged")
        self.store.record_round(run_id, round=rnd, model_version=state.version, status=status,
                                num_sampled=len(sampled), num_replies=num_replies,
                                num_accepted=agg.num_accepted, num_rejected=num_rejected,
                                num_dropped=len(missing), metrics=metrics, wall_s=wall,
                                updates=records)
        state.history.append(metrics)
        if self.fed.checkpoint_every and (rnd % self.fed.checkpoint_every == 0
                                          or rnd == self.fed.rounds):
            # Written on the store's writer thread while the next round runs.
            self.store.save_checkpoint_in_background(
                run_id, round=rnd, model_version=state.version, params=state.params,
                state={"pipeline": self.pipeline.state_dict(),
                       "dp": self.dp.state_dict() if self.dp else {}})
        self.reporter.round_finished(rnd, {**metrics, "accepted": float(agg.num_accepted),
                                           "rejected": float(num_rejected),
                                           "dropped": float(len(missing))})
        return metrics

    # ---- who answered: each reply must settle a message this driver sent to that node

    def _remember(self, pushed: dict[str, int]) -> None:
        self._sent.update({i: (node, self.state.version) for i, node in pushed.items()})

    def _settle(self, reply: Message) -> tuple[str, int, str | None]:
        """The client a reply answers for, the model version it was sent, and why the
        reply cannot be that client's answer (None when it can)."""
        claimed, msg_id = reply.metadata.src_node_id, reply.metadata.reply_to_message_id
        sent = self._sent.pop(msg_id, None)
        if sent is None:
            return str(claimed), self.state.version, (
                f"reply to message {msg_id!r}, which awaits no reply (a duplicate or a replay)")
        node, version = sent
        if claimed != node:
            return str(node), version, (f"reply to the message sent to node {node} says it "
                                        f"comes from node {claimed}")
        return str(node), version, None

    def _forget_settled(self) -> None:
        """Keep only the sent messages whose replies may still come (late, carried)."""
        open_ids = set(self._late) | {r.metadata.reply_to_message_id for _, _, r in self._carried}
        self._sent = {i: sent for i, sent in self._sent.items() if i in open_ids}

    # ---- stragglers: clock, deadline, late policy, target accuracy

    def _target_reached(self) -> bool:
        target = self.driver.target_accuracy
        last = self.state.history[-1] if self.state.history else {}
        return target > 0 and last.get("accuracy", -1.0) >= target

    def _finish_extras(self, run_id: str, summary: dict[str, Any]) -> None:
        """Add the driver, the clock and the target to the run summary."""
        summary["driver"] = self.driver.kind
        if self.clock.simulated:
            summary["simulated_time"] = round(self.clock.now(), 6)
        summary["reached_target"] = (self._target_reached()
                                     if self.driver.target_accuracy > 0 else None)

    def _resume_clock(self) -> None:
        """A resumed run's simulated clock goes on from its last recorded round."""
        if self.clock.simulated and self.state.history:
            self.clock.advance_to(self.state.history[-1].get("sim_time_s", 0.0))

    def _sample(self, rnd: int) -> list[int]:
        """The round's clients among those online and not still busy with a late task."""
        nodes = wait_for_nodes(self.grid, self.fed)
        self.clock.bind(nodes)
        self._resume_clock()
        carried = {node for _, node, _ in self._carried} | {n for n, _ in self._late.values()}
        while True:
            now = self.clock.now()
            eligible = [n for n in nodes if n not in carried and self._busy.get(n, now) <= now
                        and self.clock.online(n)]
            if eligible or not self.clock.simulated:
                break
            waiting = [t for n in nodes if n not in carried
                       for t in (self._busy.get(n, now), self.clock.next_online(n)) if t > now]
            if not waiting:
                raise RuntimeError("no client can ever take part: every one is busy with a "
                                   "carried late update")
            self.clock.advance_to(min(waiting))
        population = eligible or nodes
        if self.dp is not None and len(population) < len(nodes):
            raise RuntimeError(
                f"round {rnd}: only {len(population)} of {len(nodes)} clients could be "
                "sampled (the others are busy with a late task or offline); with [dp] who can "
                "be sampled must not depend on earlier cohorts, which the privacy accountant "
                "assumes: set driver.deadline_s = 0 (or longer than any client's task) and "
                "clients.offline_fraction = 0, or dp.mode = 'off'")
        secret = self.dp is not None and self.dp.secret_cohorts
        sampled = sample_nodes(population, self.fed, cohort_rng(self.seed, rnd, secret=secret))
        cap = self.driver.concurrency
        if cap and len(sampled) > cap:  # the concurrency limit caps the cohort
            rng = cohort_rng(self.seed, rnd, secret=secret, stream=1)
            sampled = sorted(sampled[int(i)] for i in rng.choice(len(sampled), cap,
                                                                   replace=False))
        if self.dp is not None:  # a uniform fixed-size draw of len(sampled) from population
            self.dp.note_cohort(len(population), len(sampled))
        return sampled

    def _collect(self, messages: list[Message], consume: Callable[[Message], None],
                 records: list[UpdateRecord]) -> tuple[int, list[int]]:
        """Push, wait up to the deadline and hand on-time replies to ``consume``.

        Late updates are dropped (recorded) or, with ``late_policy = "carry"``, consumed
        by the first round that is still open when they arrive, as stale updates. On a
        simulated clock the replies are computed at once and their arrival times come
        from the clock; the round lasts until the slowest on-time reply, or the deadline
        when a client is late or went offline. Returns (replies, dropped node ids).
        """
        deadline = self.driver.deadline(self.fed.round_timeout_s)
        carry = self.driver.late_policy == "carry"
        if not self.clock.simulated:
            pending: dict[str, int] = {}
            received, missing = exchange(self.grid, messages, timeout=deadline,
                                         poll=self.fed.poll_s, on_reply=consume,
                                         pending_out=pending, on_push=self._remember)
            received += self._consume_late(consume, records)
            if carry:
                pushed = time.monotonic()
                self._late.update({i: (node, pushed) for i, node in pending.items()})
                missing = [n for n in missing if n not in set(pending.values())]
            records += [UpdateRecord(client_id=str(node), fate="dropped",
                                     reason=f"late: no reply within {deadline:g} s")
                        for node in missing]
            return received, missing

        t0 = self.clock.now()
        outcomes = {m.metadata.dst_node_id: self.clock.outcome(m.metadata.dst_node_id)
                    for m in messages}
        dropped: list[int] = []
        ends = [t0]

        def route(reply: Message) -> None:
            node = reply.metadata.src_node_id
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

        received, missing = exchange(self.grid, messages, timeout=self.fed.round_timeout_s,
                                     poll=self.fed.poll_s, on_reply=route,
                                     on_push=self._remember)
        records += [UpdateRecord(client_id=str(node), fate="dropped",
                                 reason=f"late: no reply within {self.fed.round_timeout_s:g} s")
                    for node in missing]
        on_time = all(not o.lost and o.duration <= deadline for o in outcomes.values())
        end = max(ends) if on_time and not missing else t0 + deadline
        self.clock.advance_to(end)
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
                   for r in self.grid.pull_messages(list(self._late))}
        order = list(self._late)
        for msg_id in order:
            if msg_id in arrived:
                del self._late[msg_id]
                consume(arrived[msg_id])
        expired = [i for i in order if i in self._late
                   and time.monotonic() - self._late[i][1] > self.fed.round_timeout_s]
        for msg_id in expired:
            node, _ = self._late.pop(msg_id)
            records.append(UpdateRecord(
                client_id=str(node), fate="dropped",
                reason=f"late: no reply within {self.fed.round_timeout_s:g} s"))
        return sum(i in arrived for i in order)
