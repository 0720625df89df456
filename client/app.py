"""fedring's ClientApp: load the model, train on the local partition, reply with the delta.

Under a fedring server the reply is the flat delta; under any other Flower server
(e.g. ``flwr.serverapp.strategy.FedAvg``) it is Flower's convention of full weights
plus "num-examples", so the same ClientApp works with both. An evaluate message is
answered on the client's held-out split (never trained on), under either server; with
FedBN the client also measures its own model (its batch-norm layers and buffers).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from client import local_state
from client.compression import reply_record
from client.dp_sgd import DPSGDBudgetExceeded, dp_sgd_round
from client.flat_model import FlatModel
from client.protocol.errors import WireError
from client.protocol.evaluation import ClientEvaluation, evaluation_metrics
from client.protocol.flower_compat import ClientAppCallable, record_entries, reply_message
from client.protocol.keys import REPLY_DELTA, ConfigKey, MetricKey, NodeConfigKey, RecordName
from client.protocol.npy import ReplyBuffers
from client.protocol.records import metric_record, record_dict
from client.protocol.train import read_dp_sgd_prior_rounds
from client.protocol.updates import flatten_model, model_record, model_views, read_model
from client.secure_client import register_secagg
from client.task import ClientTask, LocalEvaluate, SpecResolver, TaskFactory
from client.training import (
    check_model,
    evaluate,
    has_batch_norm,
    make_optimizer,
    resolve_device,
    train,
)
from client.update_pipeline import ClientPipeline, PostTraining, fedring_pipeline
from privacy.secagg import ProtocolError

MESSAGE_REFUSED = 400  # Error code of the reply to a server message the client cannot use
# In-process, a CPU model this large trains in its reply's buffer and its delta is made
# there in place: one pass over the model instead of a subtraction into a third vector.
# Smaller, moving the model (about 10 us) costs more than the pass it saves (measured).
IN_PLACE_MIN_DIM = 1 << 16


@dataclass
class _Worker:
    """Per-process state reused across messages: one model and its optimizer, the cached
    partitions, both on the task's device (``train.device``), and the last global model
    received, flattened once for every client of its round."""

    task: ClientTask
    model: FlatModel
    data: dict[int, tuple[torch.Tensor, torch.Tensor]]
    delta: np.ndarray  # reused for every reply's delta before it is serialised
    tests: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = field(
        default_factory=dict)  # held-out splits, on the model's device
    replies: ReplyBuffers = field(default_factory=ReplyBuffers)  # in-process
    optimizer: torch.optim.Optimizer | None = None  # reset for each client
    base_record: ArrayRecord | None = None  # the record ``base_flat`` was read from
    base_views: dict[str, np.ndarray] = field(default_factory=dict)
    base_flat: np.ndarray | None = None
    # In-process: trained parameters and loss by message id, from a vectorized cohort
    # (a dict, or client.vectorized.CohortResults, which trains a batch when first asked)
    pretrained: Any = field(default_factory=dict)
    local: list[tuple[str, slice]] = field(default_factory=list)  # what FedBN keeps
    batch_norm: bool = False  # whether the model has batch norm (found once)
    lent: bool = False  # the model's storage is a reply's delta (made there in place)
    steps: ClientPipeline | None = None  # the last post-training steps built, and the
    steps_key: tuple[Any, ...] = ()  # settings they were built from (``post_training``)

    def __post_init__(self) -> None:
        self.local = local_state.local_spans(self.model)
        self.batch_norm = has_batch_norm(self.model.module)

    def global_model(self, record: ArrayRecord) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The sent model's per-tensor views and its flat float32 copy.

        A server sends one record to every client of a round; in-process, every message
        carries that very object, whose arrays are immutable bytes, so it is checked and
        flattened once per round, not once per client (the reference kept here keeps its
        identity from being reused by another object).
        """
        if record is not self.base_record or self.base_flat is None:
            layout = self.model.layout
            views = model_views(record, layout)
            if self.base_flat is None:
                self.base_flat = np.empty(layout.dim, dtype=np.float32)
            self.base_record = None  # not valid until the copy below succeeded
            flatten_model(views, layout, out=self.base_flat)
            self.base_record, self.base_views = record, views
        return self.base_views, self.base_flat

    def post_training(self, config: ConfigRecord, fedbn: bool) -> ClientPipeline:
        """The post-training steps of ``config``, built again only when the settings they
        are built from change: every client of a round gets the same, and the centre of
        client-side clipping is then read once a round, not once a client. Built afresh
        each time under local DP, whose noise generator is this process's own."""
        settings = _settings(config)
        momentum = settings.get(ConfigKey.CLIENT_MOMENTUM)
        radius = settings.get(ConfigKey.CLIP_RADIUS)
        key = (fedbn, type(momentum), momentum, type(radius), radius,
               settings.get(ConfigKey.CENTER))  # (the centre's bytes: compared by identity)
        if self.steps is not None and self.task.local_dp is None and _same(key, self.steps_key):
            return self.steps
        self.steps = None  # (a malformed setting raises below: nothing is kept)
        self.steps = fedring_pipeline(self.task, config, local=self.local if fedbn else None,
                                      dim=self.model.dim)
        self.steps_key = key
        return self.steps

    def writable_model(self, *, into_reply: bool = False) -> FlatModel:
        """The model, ready to be written: moved out of a buffer it lent to a reply (which
        the server may still hold), or, ``into_reply``, into a free reply buffer, where
        its delta can then be made in place and sent without a copy. A model already in
        a reply buffer that nothing else refers to any more (the server has dropped its
        reply) stays there: moving a model re-points every parameter."""
        if (self.lent or into_reply) and not self._in_a_dropped_reply():
            self.model.rebind(self.replies.delta(self.model.dim))
        self.lent = False
        return self.model

    def _in_a_dropped_reply(self) -> bool:
        flat_np = self.model.flat_np
        # the vector's references: the model's attribute, its tensor's storage, ``flat_np``
        # and getrefcount's argument (a LocalUpdate or other view still alive adds one)
        return sys.getrefcount(flat_np) == 4 and self.replies.unused_but_for(flat_np)

    def train_one(self, x: torch.Tensor, y: torch.Tensor, seed: int,
                  global_params: list[torch.Tensor] | None = None) -> float:
        """Train the model in place on one client's data, as every client is trained (the
        worker's optimizer, reset); the mean training loss."""
        return train(self.model.module, x, y, self.task.train_config, seed=seed,
                     global_params=global_params, optimizer=self.local_optimizer(),
                     batch_norm=self.batch_norm)

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The worker's optimizer over its model (``train`` resets it for each client)."""
        if self.optimizer is None:
            params = [p for p in self.model.module.parameters() if p.requires_grad]
            self.optimizer = make_optimizer(params, self.task.train_config)
        return self.optimizer


@dataclass
class LocalUpdate:
    """One local training step's result: the flat delta (a reused buffer) and its metrics."""

    delta: np.ndarray
    metrics: MetricRecord
    config: ConfigRecord
    base: dict[str, np.ndarray]
    base_flat: np.ndarray  # the global model, flat (the worker's buffer: read it at once)
    trained: np.ndarray  # the trained model, flat (a buffer too; in place: the delta)
    model: FlatModel
    partition_id: int
    noised: bool


def record_of(content: RecordDict, kind: type, preferred: str) -> Any:
    """The record named ``preferred`` if it is a ``kind``, else the first ``kind`` in
    ``content``; WireError when there is none."""
    entries = record_entries(content)
    found = (content if entries is None else entries).get(preferred)
    if isinstance(found, kind):
        return found
    for value in content.values():
        if isinstance(value, kind):
            return value
    raise WireError(f"message has no {kind.__name__}")


def training_seed(seed: int, server_round: int, partition_id: int) -> int:
    """A per-client, per-round seed that does not depend on the engine or process."""
    digest = hashlib.sha256(f"{seed}:{server_round}:{partition_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# Per-process state, shared by every copy of the ClientApp in this process: Flower's Ray
# backend unpickles the app for each message, while the process (and this cache) lives on.
_WORKERS: dict[str, _Worker] = {}
_SPECS: dict[str, str] = {}  # run config (JSON) -> task spec (JSON), for stock strategies


class FedringClient:
    """The train and evaluate handlers, with the task injected."""

    def __init__(self, task_factory: TaskFactory, resolve_spec: SpecResolver) -> None:
        self._task_factory = task_factory
        self._resolve_spec = resolve_spec

    def _worker(self, config: Mapping[str, Any], context: Context) -> _Worker:
        raw = config.get(ConfigKey.TASK)
        if raw is not None and not isinstance(raw, str):
            raise WireError(f"config '{ConfigKey.TASK}' must be a JSON string, got "
                            f"{type(raw).__name__}")
        if isinstance(raw, str):
            key = raw
        else:
            run_config = json.dumps(dict(context.run_config), sort_keys=True, default=str)
            if run_config not in _SPECS:  # resolving a scenario is ~1 ms: once per process
                _SPECS[run_config] = json.dumps(self._resolve_spec(dict(context.run_config)),
                                                sort_keys=True)
            key = _SPECS[run_config]
        worker = _WORKERS.get(key)
        if worker is None:
            try:
                task = self._task_factory(json.loads(key))
                device = resolve_device(task.train_config.device)  # "cuda" without CUDA
                module = task.build_model()
                check_model(module, task.train_config)  # e.g. DP-SGD with batch norm
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise WireError(f"config '{ConfigKey.TASK}' is not a task this client can "
                                f"build: {exc}") from exc
            model = FlatModel(module, device)
            worker = _Worker(task=task, model=model, data={},
                             delta=np.empty(model.dim, dtype=np.float32))
            _WORKERS.clear()  # one task per process at a time
            _WORKERS[key] = worker
        return worker

    @staticmethod
    def _partition_id(context: Context) -> int:
        pid = context.node_config.get(NodeConfigKey.PARTITION_ID)
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise ValueError("the node config needs an integer 'partition-id' "
                             "(e.g. flower-supernode --node-config 'partition-id=0')")
        return pid

    def _data(self, worker: _Worker, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        if pid not in worker.data:  # moved to the model's device once
            x, y = worker.task.partition(pid)
            worker.data[pid] = (x.to(worker.model.device), y.to(worker.model.device))
        return worker.data[pid]

    @staticmethod
    def _held_out(worker: _Worker, pid: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if pid not in worker.tests:  # moved to the model's device once
            held = worker.task.client_test(pid)
            worker.tests[pid] = None if held is None else (held[0].to(worker.model.device),
                                                           held[1].to(worker.model.device))
        return worker.tests[pid]

    def local_update(self, msg: Message, context: Context) -> LocalUpdate:
        """Load the sent model, train on this node's partition; the delta and its metrics."""
        config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
        settings = _settings(config)  # its entries, each read one dict lookup
        worker = self._worker(settings, context)
        pid = self._partition_id(context)
        record = record_of(msg.content, ArrayRecord, RecordName.ARRAYS)
        model = worker.model
        base, base_flat = worker.global_model(record)
        fedbn = _flag(settings, ConfigKey.LOCAL_BUFFERS)
        in_process = context.node_config.get(NodeConfigKey.IN_PROCESS)
        pretrained = worker.pretrained.pop(msg.metadata.message_id, None) if in_process \
            else None
        in_place = (in_process and pretrained is None and model.on_host
                    and model.dim >= IN_PLACE_MIN_DIM and ConfigKey.REPLY in settings)
        worker.writable_model(into_reply=in_place)
        if pretrained is None or fedbn or model.exact:  # (trained with its cohort: the
            np.copyto(model.flat_np, base_flat)       # model itself is not used)
        local_state.restore(context.state, model, fedbn)  # this node's own buffers
        model.to_device()  # the one copy to the device (none on the CPU)
        seed = training_seed(worker.task.seed, _int_setting(settings, ConfigKey.SERVER_ROUND),
                             pid)
        trained, values = self._local_training(worker, pid, seed, config, context, pretrained)
        model.to_host()  # the one copy back to the host (none on the CPU)
        local_state.keep(context.state, model, fedbn)
        # In-process, the delta is written straight into the buffer its reply will carry.
        if in_place:  # the model trained in that buffer: ``trained`` becomes the delta
            delta, worker.lent = trained, True
        else:
            delta = worker.replies.delta(model.dim) if in_process else worker.delta
        np.subtract(trained, base_flat, out=delta)
        steps = worker.post_training(config, fedbn)
        done = steps.run(PostTraining(delta, values, partition_id=pid, seed=seed,
                                      state=context.state))
        return LocalUpdate(delta=done.delta, metrics=metric_record(values), config=config,
                           base=base, base_flat=base_flat, trained=trained, model=model,
                           partition_id=pid, noised=done.noised)

    def _local_training(self, worker: _Worker, pid: int, seed: int, config: ConfigRecord,
                        context: Context, pretrained: tuple[np.ndarray, float] | None
                        ) -> tuple[np.ndarray, dict[str, Any]]:
        """Train the model (on its device) on this node's partition, or take what its
        cohort trained; the trained flat model (on the host once copied back) and the
        reply's metrics."""
        model = worker.model
        global_params = None
        if worker.task.train_config.proximal_mu > 0:  # the anchor: parameters only
            global_params = [p.detach().clone() for p in model.module.parameters()]
        trained = model.flat_np
        if worker.task.trainer is not None:  # the task's own loop (a user's task module)
            count, results = worker.task.trainer(model.module, pid, seed)
            metrics = MetricRecord({MetricKey.NUM_EXAMPLES: count, **results})  # checked
            if "loss" in results:
                metrics["train_loss"] = results["loss"]
            values: dict[str, Any] = dict(metrics)
        else:
            x, y = self._data(worker, pid)
            values = {MetricKey.NUM_EXAMPLES: len(x)}
            if pretrained is not None:  # trained with its cohort (client.vectorized)
                trained, loss = pretrained
            elif worker.task.train_config.dp_sgd:  # composed with this node's rounds
                loss, figures = dp_sgd_round(model.module, x, y, worker.task.train_config,
                                             context.state, read_dp_sgd_prior_rounds(config))
                values.update(figures)
            else:
                loss = worker.train_one(x, y, seed, global_params)
            values["train_loss"] = loss
        return trained, values

    def train(self, msg: Message, context: Context) -> Message:
        update = self.local_update(msg, context)
        config, metrics, delta, model = update.config, update.metrics, update.delta, update.model
        pid = update.partition_id
        settings = _settings(config)
        if settings.get(ConfigKey.REPLY, REPLY_DELTA) != REPLY_DELTA:
            raise WireError(f"config '{ConfigKey.REPLY}' must be 'delta' when given, got "
                            f"{settings[ConfigKey.REPLY]!r}")
        if ConfigKey.REPLY in settings:
            version = _int_setting(settings, ConfigKey.VERSION)
            values = record_entries(metrics)
            metrics = metric_record({**(metrics if values is None else values),
                                     MetricKey.BASE_VERSION: version, MetricKey.PARTITION: pid})
            name, record = reply_record(config, delta, context.state, pid)  # compressed?
            content = record_dict({name: record, RecordName.METRICS: metrics})
        else:  # Flower's convention: full weights (base + the possibly noised delta)
            weights = update.base_flat + delta if update.noised else update.trained
            content = record_dict({RecordName.ARRAYS: model_record(model.layout, weights),
                                   RecordName.METRICS: metrics})
        return reply_message(content, msg)  # Message(content, reply_to=msg), leaner

    def evaluation(self, msg: Message, context: Context) -> ClientEvaluation:
        """The sent model's figures on this node's held-out split and, with FedBN and a
        batch norm of its own in the node state, its own model's; WireError when the
        client has no held-out split. The worker's cached global model and reply buffers
        are left as they are, and the model in train mode."""
        return self._evaluation(msg, context)[0]

    def _evaluation(self, msg: Message, context: Context
                    ) -> tuple[ClientEvaluation, dict[str, float]]:
        """``evaluation`` and the task's own other figures (its ``evaluate``'s)."""
        config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
        worker = self._worker(config, context)
        pid = self._partition_id(context)
        record = record_of(msg.content, ArrayRecord, RecordName.ARRAYS)
        held = None
        if worker.task.evaluator is None:
            held = self._held_out(worker, pid)
            if held is None or len(held[1]) == 0:
                raise no_held_out_split(pid)
        model = worker.writable_model()  # (out of a buffer a reply may still hold)
        return measure(worker.task.evaluator, model, record, pid, held, context,
                       fedbn=_flag(config, ConfigKey.LOCAL_BUFFERS))

    def evaluate(self, msg: Message, context: Context) -> Message:
        figures, extra = self._evaluation(msg, context)
        metrics = evaluation_metrics(figures)
        for key, value in extra.items():  # e.g. a task module's own metric, as "eval_<key>"
            metrics.setdefault(f"eval_{key}", value)
        return Message(RecordDict({RecordName.METRICS: metrics}), reply_to=msg)


def no_held_out_split(pid: int) -> WireError:
    return WireError(f"partition {pid} has no held-out split: set data.client_test_fraction "
                     "> 0 (a task module: task.client_test_fraction > 0, or give "
                     "load_client_test)")


def measure(evaluator: LocalEvaluate | None, model: FlatModel, record: ArrayRecord, pid: int,
            held: tuple[torch.Tensor, torch.Tensor] | None, context: Context, *,
            fedbn: bool) -> tuple[ClientEvaluation, dict[str, float]]:
    """Evaluate the model in ``record`` on the held-out split ``held`` (or with the task's
    own ``evaluator``) in ``model``; with ``fedbn`` and this node's own batch norm saved in
    ``context.state``, its own model too (``client.local_state``). The figures, and the
    evaluator's other metrics for the sent model. ``model`` is left holding the last model
    measured, in train mode."""
    read_model(record, model.layout, out=model.flat_np)
    local_state.restore(context.state, model, False)  # its exact buffers (counts) only
    personal = fedbn and bool(local_state.local_spans(model)) and isinstance(
        context.state.get(local_state.LOCAL_STATE), ArrayRecord)
    try:
        model.to_device()
        count, loss, acc, extra = _figures(evaluator, model.module, pid, held)
        if not personal:
            return ClientEvaluation(num_examples=count, loss=loss, accuracy=acc), extra
        local_state.restore(context.state, model, True)  # its own batch-norm layers
        model.to_device()
        _, loss_p, acc_p, _ = _figures(evaluator, model.module, pid, held)
        return ClientEvaluation(num_examples=count, loss=loss, accuracy=acc,
                                loss_personal=loss_p, accuracy_personal=acc_p), extra
    finally:
        model.module.train()  # the next local training starts as it always does


def _figures(evaluator: LocalEvaluate | None, module: torch.nn.Module, pid: int,
             held: tuple[torch.Tensor, torch.Tensor] | None
             ) -> tuple[int, float, float, dict[str, float]]:
    """(examples, loss, accuracy, the evaluator's other metrics) of ``module`` on the
    held-out split."""
    if evaluator is None:
        if held is None or len(held[1]) == 0:
            raise no_held_out_split(pid)
        loss, acc = evaluate(module, *held)
        return len(held[1]), loss, acc, {}
    count, result = evaluator(module, pid)
    if count == 0:
        raise no_held_out_split(pid)
    missing = [k for k in ("loss", "accuracy") if k not in result]
    if missing:
        raise WireError(f"the task's evaluate() returned {sorted(result)}, without "
                        f"{' and '.join(repr(k) for k in missing)}: federated evaluation "
                        "needs both")
    extra = {k: v for k, v in result.items() if k not in ("loss", "accuracy")}
    return count, float(result["loss"]), float(result["accuracy"]), extra


def make_client_app(task_factory: TaskFactory, resolve_spec: SpecResolver) -> ClientApp:
    """A Flower ClientApp running fedring's local training for the injected task."""
    client = FedringClient(task_factory, resolve_spec)
    app = ClientApp(mods=[refuse_unusable_messages])
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    register_secagg(app, client.local_update, client.evaluation)
    return app


def _same(key: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    """Whether two ``_Worker.post_training`` keys are the same settings: equal entries,
    and the same centre object (bytes shared by every message of a round)."""
    return len(key) == len(other) and key[-1] is other[-1] and key[:-1] == other[:-1]


def _settings(config: ConfigRecord) -> Mapping[str, Any]:
    """A config record's entries as the plain dict Flower keeps them in (read here, never
    written), or the record itself where Flower keeps them otherwise: the same values,
    each read one dict lookup instead of Flower's Mapping layers (several Python calls,
    slow right after a training has evicted them from the caches)."""
    entries = record_entries(config)
    return config if entries is None else entries


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise WireError(f"config '{key}' must be a boolean, got {value!r}")
    return value


def _int_setting(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"config '{key}' must be an integer, got {value!r}")
    return value


def refuse_unusable_messages(msg: Message, context: Context,
                             call_next: ClientAppCallable) -> Message:
    """A Flower mod: a server message the client cannot use (a missing or malformed record,
    a protocol violation) or a round its DP-SGD budget refuses gets an error reply naming
    the problem; the app does not fail."""
    try:
        return call_next(msg, context)
    except (WireError, ProtocolError, DPSGDBudgetExceeded) as exc:
        reason = f"{msg.metadata.message_type} message refused: {exc}"
        return Message(Error(MESSAGE_REFUSED, reason), reply_to=msg)


def task_spec_json(spec: Mapping[str, Any]) -> str:
    """Canonical JSON of a task spec, as sent in the "fedring.task" config entry."""
    return json.dumps(dict(spec), sort_keys=True)
