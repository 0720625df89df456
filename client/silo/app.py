"""fedring's ClientApp for silos: data-parallel training inside, cross-silo rounds over the ring.

A silo answers the same messages as any fedring client, and one more:

- ``train``: load the global model, train on the silo's partition, reply with the delta.
  With a :class:`~client.silo.job.SiloGroup` of several processes (``fedring silo
  --nproc-per-node N``) training is DDP over them; alone it is ``client.training.train``.
  When the train config asks for ``silo.learners`` > 1 (``client.protocol.learners``),
  each process trains that many learners with SMA instead (``client.silo.learners``).
- ``train.cross_silo``: train likewise, then join the round's ring with the other silos
  (``client.silo.ring``) and reply with the digest of the aggregate; the silo at ring
  rank 0 adds the aggregate itself. The server never sees a single silo's delta.
- ``query.cross_silo`` (secure cross-silo rounds, after ``train.secagg`` and the key
  stages): mask the update as a SecAgg+ client does (FORWARDED_SHARES -> MASKED_INPUT,
  ``client.secure_client``), sum the masked words over the ring and reply with the
  digest of the masked sum; ring rank 0 adds the masked sum itself.
- ``train.gossip`` (gossip rounds, ``client.silo.gossip``): train the silo's own model
  (the server's initial model in its first round), mix it with its neighbours' in the
  round's group, evaluate the mixed model on the task's held-out split; reply with
  metrics only.
- ``evaluate`` (federated evaluation, on the task's held-out split, with the silo's own
  model too under FedBN) and the secure-aggregation stages, as fedring's ClientApp.

Each (task, node) has its own model and data, so several silos can live in one process
(the in-process engine runs them on threads).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from aggregation.ring import RingError, RingTimeout
from client import local_state
from client.app import (
    FedringClient,
    LocalUpdate,
    measure,
    no_held_out_split,
    record_of,
    training_seed,
)
from client.dp_sgd import dp_sgd_round
from client.flat_model import FlatModel
from client.protocol.errors import WireError
from client.protocol.evaluation import ClientEvaluation
from client.protocol.gossip import GOSSIP_ACTION, GossipMetric, GossipSpec
from client.protocol.keys import ConfigKey, MetricKey, RecordName
from client.protocol.learners import LearnerSpec
from client.protocol.ring import (
    CROSS_SILO_ACTION,
    RingKey,
    RingMetric,
    RingRecord,
    RingSpec,
    RingStatus,
    ring_spec,
)
from client.protocol.secagg import protocol_payload
from client.protocol.train import read_dp_sgd_prior_rounds
from client.protocol.updates import delta_record, flatten_model, model_views
from client.secure_client import SecureClient, register_secagg
from client.silo.gossip import HeldModel, mix
from client.silo.learners import LearnerState, train_learners
from client.silo.ring import RingResult, blamed_ranks, ring_aggregate, ring_sum_words
from client.task import ClientTask, SpecResolver, TaskFactory
from client.training import evaluate, train
from client.update_pipeline import PostTraining, silo_pipeline
from privacy.secagg.messages import decode_masked_input


@dataclass
class SiloWorker:
    """One task's model and data in this process, on the silo's device."""

    task: ClientTask
    model: FlatModel  # on the silo's device; ``model.flat_np``: what comes in and goes out
    module: torch.nn.Module  # what trains: ``model.module``
    device: torch.device
    delta: np.ndarray
    data: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tests: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = field(
        default_factory=dict)  # held-out splits, on the device
    learners: dict[tuple[int, int], LearnerState] = field(
        default_factory=dict)  # per (run, partition): this process's SMA learners

    @classmethod
    def build(cls, task: ClientTask, device: torch.device) -> SiloWorker:
        model = FlatModel(task.build_model(), device)
        return cls(task=task, model=model, module=model.module, device=device,
                   delta=np.empty(model.dim, dtype=np.float32))

    def partition(self, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the silo trains on: the task's partition less its held-out split."""
        if pid not in self.data:
            x, y = self.task.partition(pid)
            self.data[pid] = (x.to(self.device), y.to(self.device))
        return self.data[pid]

    def held_out(self, pid: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The task's held-out split of the partition (None when it holds none out)."""
        if pid not in self.tests:
            held = self.task.client_test(pid)
            self.tests[pid] = None if held is None or len(held[1]) == 0 else (
                held[0].to(self.device), held[1].to(self.device))
        return self.tests[pid]

    def learner_state(self, run: int, pid: int) -> LearnerState:
        """This process's SMA learners of partition ``pid`` between the rounds of run
        ``run`` (another run's are dropped: a run starts its learners afresh)."""
        if any(r != run for r, _ in self.learners):
            self.learners = {k: v for k, v in self.learners.items() if k[0] == run}
        return self.learners.setdefault((run, pid), LearnerState())

    def to_module(self) -> None:
        """Copy the host vector into the training module (a no-op on the CPU)."""
        self.model.to_device()

    def from_module(self) -> None:
        """Copy the trained module's parameters and buffers back into the host vector."""
        self.model.to_host()


class WorkerCache:
    """Workers by (task, slot): one slot per silo living in this process."""

    def __init__(self, task_factory: TaskFactory, device: torch.device) -> None:
        self._factory = task_factory
        self.device = device
        self._workers: dict[Any, tuple[str, SiloWorker]] = {}
        self._lock = threading.Lock()

    def get(self, task_key: str, slot: Any = 0) -> SiloWorker:
        with self._lock:
            held = self._workers.get(slot)
            if held is None or held[0] != task_key:
                held = (task_key, SiloWorker.build(self._factory(json.loads(task_key)),
                                                   self.device))
                self._workers[slot] = held  # one task per slot at a time
            return held[1]


class Group(Protocol):
    """The silo's processes as the ClientApp sees them (``client.silo.job.SiloGroup``)."""

    size: int

    def train(self, worker: SiloWorker, task_key: str, pid: int, seed: int,
              learners: LearnerSpec | None = None, run: int = 0) -> float: ...


def update_problem(delta: np.ndarray, max_norm: float) -> tuple[str | None, float]:
    """Why a delta may not enter the ring (non-finite, or norm above ``max_norm`` > 0), and
    its norm."""
    norm = float(np.sqrt(np.einsum("i,i->", delta, delta, dtype=np.float64)))
    if not np.isfinite(norm):
        return "delta has NaN or Inf values", norm
    if max_norm > 0 and norm > max_norm:
        return f"delta norm {norm:.4g} exceeds aggregation.max_norm {max_norm:g}", norm
    return None, norm


class SiloClient(FedringClient):
    """fedring's client whose local training runs on the silo's processes."""

    def __init__(self, task_factory: TaskFactory, resolve_spec: SpecResolver, *,
                 group: Group | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(task_factory, resolve_spec)
        self.group = group
        self.workers = WorkerCache(task_factory, torch.device(device))
        self.secure = SecureClient(self.local_update)  # its session lives in Context.state
        self._specs: dict[str, str] = {}

    def _task_key(self, config: ConfigRecord, context: Context) -> str:
        raw = config.get(ConfigKey.TASK)
        if isinstance(raw, str):
            return raw
        run_config = json.dumps(dict(context.run_config), sort_keys=True, default=str)
        if run_config not in self._specs:
            self._specs[run_config] = json.dumps(self._resolve_spec(dict(context.run_config)),
                                                 sort_keys=True)
        return self._specs[run_config]

    def local_update(self, msg: Message, context: Context, *,
                     start: np.ndarray | None = None) -> LocalUpdate:
        """Load the sent model (or ``start``, the silo's own), train on the silo's partition
        (less its held-out split); the delta and its metrics."""
        config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
        key = self._task_key(config, context)
        worker = self.workers.get(key, context.node_id)
        if worker.task.trainer is not None:
            raise WireError("a silo trains with fedring's data-parallel loop, which cannot run "
                            "the task module's own train(): remove train() from the module")
        pid = self._partition_id(context)
        x, y = worker.partition(pid)
        model, cfg = worker.model, worker.task.train_config
        if start is None:
            base = model_views(record_of(msg.content, ArrayRecord, RecordName.ARRAYS),
                               model.layout)
            flatten_model(base, model.layout, out=model.flat_np)
        else:
            if start.shape != (model.dim,):
                raise WireError(f"the silo's own model has {start.size} values, the task's "
                                f"model {model.dim}")
            np.copyto(model.flat_np, start)
            base = model.layout.unflatten(start)
        delta = worker.delta
        np.copyto(delta, model.flat_np)  # the global model, until the delta replaces it
        base_flat = delta.copy()  # kept for a full-weights reply
        fedbn = config.get(ConfigKey.LOCAL_BUFFERS) is True
        local_state.restore(context.state, model, fedbn)  # this silo's own buffers
        worker.to_module()
        seed = training_seed(worker.task.seed, int(config.get(ConfigKey.SERVER_ROUND, 0)), pid)
        metrics = MetricRecord({MetricKey.NUM_EXAMPLES: len(x)})
        learners = LearnerSpec.of(config)
        if self.group is not None and self.group.size > 1:
            loss = self.group.train(worker, key, pid, seed, learners, context.run_id)
        elif learners.learners > 1:
            try:
                loss = train_learners(worker.module, x, y, cfg, learners, seed=seed,
                                      state=worker.learner_state(context.run_id, pid))
            except ValueError as exc:
                raise WireError(str(exc)) from None
        elif cfg.dp_sgd:  # composed with this silo's earlier rounds
            loss, figures = dp_sgd_round(worker.module, x, y, cfg, context.state,
                                         read_dp_sgd_prior_rounds(config))
            metrics.update(figures)
        else:
            start_params = ([p.detach().clone() for p in worker.module.parameters()]
                            if cfg.proximal_mu > 0 else None)
            loss = train(worker.module, x, y, cfg, seed=seed, global_params=start_params)
        worker.from_module()
        local_state.keep(context.state, model, fedbn)
        metrics["train_loss"] = loss
        np.subtract(model.flat_np, delta, out=delta)
        steps = silo_pipeline(worker.task,
                              local=local_state.local_spans(model) if fedbn else None)
        done = steps.run(PostTraining(delta, metrics, partition_id=pid, seed=seed,
                                      state=context.state))
        return LocalUpdate(delta=done.delta, metrics=metrics, config=config, base=base,
                           base_flat=base_flat, trained=model.flat_np, model=model,
                           partition_id=pid, noised=done.noised)

    def cross_silo(self, msg: Message, context: Context) -> Message:
        """Train, join the round's ring, reply with the digest (ring rank 0: and the aggregate)."""
        ring, spec = ring_spec(msg.content)
        update = self.local_update(msg, context)
        metrics = update.metrics
        weight = (float(metrics[MetricKey.NUM_EXAMPLES])
                  if ring.get(RingKey.WEIGHT_BY) == "examples" else 1.0)
        reason, norm = update_problem(update.delta, float(ring.get(RingKey.MAX_NORM, 0.0)))
        delta = update.delta
        if reason is not None:  # still joins the ring, which needs every silo, with weight 0
            weight, delta = 0.0, np.zeros_like(delta)
        metrics[RingMetric.WEIGHT] = weight
        if np.isfinite(norm):
            metrics[RingMetric.NORM] = norm
        result = ConfigRecord({RingKey.STATUS: RingStatus.OK, RingKey.RING_RANK: spec.rank,
                               RingKey.REJECTED: reason or ""})
        device = self.workers.device
        return self._ring_reply(msg, metrics, result, spec, lambda: ring_aggregate(
            delta, weight, spec, cuda_device=device.index or 0))

    def secure_ring(self, msg: Message, context: Context) -> Message:
        """Mask this silo's update (its SecAgg+ session answers FORWARDED_SHARES), sum the
        masked words over the round's ring, reply with the masked sum's digest (ring rank
        0: and the masked sum). The masked vector itself goes only into the ring."""
        ring, spec = ring_spec(msg.content)
        bits = ring.get(RingKey.BITS)
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise WireError(f"a secure cross-silo message needs an integer '{RingKey.BITS}'")
        masked = self.secure.query(msg, context)  # FORWARDED_SHARES -> MASKED_INPUT
        _, own = decode_masked_input(protocol_payload(masked.content))
        result = ConfigRecord({RingKey.STATUS: RingStatus.OK, RingKey.RING_RANK: spec.rank,
                               RingKey.FAILED: [int(v) for v in own.failed]})
        device = self.workers.device
        return self._ring_reply(msg, MetricRecord(), result, spec, lambda: ring_sum_words(
            own.vector, bits, spec, cuda_device=device.index or 0))

    def gossip(self, msg: Message, context: Context) -> Message:
        """Train this silo's own model, mix it with its neighbours' in the round's group,
        evaluate the mixed model on the held-out split; reply with metrics only."""
        ring, spec = ring_spec(msg.content)
        plan = GossipSpec.of(ring, spec.rank, spec.size)
        config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
        rnd = int(config.get(ConfigKey.SERVER_ROUND, 0))
        held = HeldModel(context.state)
        if isinstance(msg.content.get(RecordName.ARRAYS), ArrayRecord):  # the first round
            update = self.local_update(msg, context)
            held.start(plan.commit_round, update.base_flat)
        else:
            try:
                start = held.start(plan.commit_round, None)
            except ValueError as exc:
                raise WireError(str(exc)) from None
            update = self.local_update(msg, context, start=start)
        metrics = update.metrics
        result = ConfigRecord({RingKey.STATUS: RingStatus.OK, RingKey.RING_RANK: spec.rank})
        device = self.workers.device
        try:
            self._check_backend(spec)
            out = mix(update.trained, plan.neighbours, plan.weights, plan.self_weight, spec,
                      cuda_device=device.index or 0)
        except RingError as exc:
            return self._failure_reply(msg, metrics, result, exc)
        held.keep_pending(rnd, out.mixed)
        worker = self.workers.get(self._task_key(config, context), context.node_id)
        np.copyto(worker.model.flat_np, out.mixed)
        worker.to_module()
        held = worker.held_out(update.partition_id)
        if held is not None:  # (none: the server records why there are no figures)
            loss, acc = evaluate(worker.module, *held)
            worker.module.train()
            metrics.update({GossipMetric.ACCURACY: acc, GossipMetric.LOSS: loss,
                            GossipMetric.HELDOUT: len(held[1])})
        metrics.update({GossipMetric.DISTANCE: out.distance, GossipMetric.BYTES: out.bytes_sent,
                        GossipMetric.MEASURE_BYTES: out.measure_bytes})
        result.update({RingKey.DIGEST: out.digest, RingKey.RING_S: out.seconds})
        return Message(RecordDict({RecordName.METRICS: metrics, RingRecord.RESULT: result}),
                       reply_to=msg)

    def _evaluation(self, msg: Message, context: Context
                    ) -> tuple[ClientEvaluation, dict[str, float]]:
        """Federated evaluation as fedring's ClientApp does it, on this silo's model."""
        config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
        worker = self.workers.get(self._task_key(config, context), context.node_id)
        pid = self._partition_id(context)
        record = record_of(msg.content, ArrayRecord, RecordName.ARRAYS)
        evaluator = worker.task.evaluator
        held = worker.held_out(pid) if evaluator is None else None
        if evaluator is None and held is None:
            raise no_held_out_split(pid)
        return measure(evaluator, worker.model, record, pid, held, context,
                       fedbn=config.get(ConfigKey.LOCAL_BUFFERS) is True)

    def _check_backend(self, spec: RingSpec) -> None:
        device = self.workers.device
        if spec.backend == "nccl" and device.type != "cuda":
            raise RingError(f"silo.backend 'nccl' needs a GPU in every silo; this one runs "
                            f"on {device}", step="setup")

    @staticmethod
    def _failure_reply(msg: Message, metrics: MetricRecord, result: ConfigRecord,
                       exc: RingError) -> Message:
        """The reply of a silo whose ring failed: the text, the step and the ring ranks it
        points at."""
        result[RingKey.STATUS] = RingStatus.TIMEOUT if isinstance(exc, RingTimeout) \
            else RingStatus.RING_ERROR
        result[RingKey.ERROR] = str(exc)
        result[RingKey.STEP] = exc.step
        result[RingKey.PEERS] = blamed_ranks(exc)  # the ring ranks it points at
        return Message(RecordDict({RecordName.METRICS: metrics, RingRecord.RESULT: result}),
                       reply_to=msg)

    def _ring_reply(self, msg: Message, metrics: MetricRecord, result: ConfigRecord,
                    spec: RingSpec, run: Callable[[], RingResult]) -> Message:
        """Run this silo's part of the ring; the reply: the digest (ring rank 0: and the
        aggregate), or the failure and the ring ranks it points at."""
        try:
            self._check_backend(spec)
            out = run()
        except RingError as exc:
            return self._failure_reply(msg, metrics, result, exc)
        result.update({RingKey.DIGEST: out.digest, RingKey.TOTAL_WEIGHT: out.total_weight,
                       RingKey.COUNT: out.count, RingKey.RING_S: out.seconds})
        content = RecordDict({RecordName.METRICS: metrics, RingRecord.RESULT: result})
        if spec.rank == 0:
            content[RingRecord.AGGREGATE] = delta_record(out.aggregate)
        return Message(content, reply_to=msg)


def make_silo_client_app(client: SiloClient) -> ClientApp:
    """A ClientApp serving ``client``: train, train.cross_silo, query.cross_silo,
    train.gossip, evaluate and secagg."""
    app = ClientApp()
    app.train()(client.train)
    app.train(CROSS_SILO_ACTION)(client.cross_silo)
    app.query(CROSS_SILO_ACTION)(client.secure_ring)
    app.train(GOSSIP_ACTION)(client.gossip)
    app.evaluate()(client.evaluate)
    register_secagg(app, client.local_update)
    return app
