"""Hostile replies, one field at a time, in a real run on the in-process engine.

Every client is honest in rounds 1 and 3. In round 2 each hostile client corrupts one
field of its honest reply, one case per client. Each bad reply must be rejected with a
specific reason that is stored and logged, the round must complete with exactly the
honest clients' updates, and everything stored before must stay intact.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import NPY_STYPE, npy_array, npy_view
from client.protocol.updates import delta_record
from server.app import make_server_app
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

HONEST = 3  # partitions 0..2 (nodes 1..3) never misbehave
HOSTILE_ROUND = 2
MAX_NORM = 1e3


@dataclass
class Sent:
    """What a hostile client sees when it corrupts its reply."""

    msg: Message
    honest: Message  # the reply an honest client would send
    first: Message  # this client's reply of round 1
    dim: int

    @property
    def delta(self) -> np.ndarray:
        return npy_view(self.honest.content["delta"]["delta"]).copy()

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.honest.content["metrics"])

    def reply(self, **records: Any) -> Message:
        """The honest reply with some records replaced (None removes one)."""
        content = dict(self.honest.content.items())
        content.update(records)
        return Message(RecordDict({k: v for k, v in content.items() if v is not None}),
                       reply_to=self.msg)

    def with_delta(self, delta: np.ndarray) -> Message:
        return self.reply(delta=delta_record(delta))

    def with_metrics(self, **values: Any) -> Message:
        metrics = {k: v for k, v in {**self.metrics, **values}.items() if v is not None}
        return self.reply(metrics=MetricRecord(metrics))

    def with_delta_bytes(self, data: bytes, stype: str = NPY_STYPE) -> Message:
        array = Array(dtype="float32", shape=(self.dim,), stype=stype, data=data)
        return self.reply(delta=ArrayRecord({"delta": array}))

    def forged(self, reply: Message, **meta: Any) -> Message:
        for key, value in meta.items():
            reply.metadata.__dict__[f"_{key}"] = value
        return reply

    def full_weights(self, arrays: dict[str, np.ndarray]) -> Message:
        record = ArrayRecord({name: npy_array(a) for name, a in arrays.items()})
        metrics = MetricRecord({MetricKey.NUM_EXAMPLES: 10})
        return Message(RecordDict({"arrays": record, "metrics": metrics}), reply_to=self.msg)

    def model(self) -> dict[str, np.ndarray]:
        return {name: npy_view(a).copy() for name, a in self.msg.content["arrays"].items()}


def _npy(header: dict[str, Any], payload: bytes) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue() + payload


def _wrong_model(sent: Sent, change: Callable[[dict[str, np.ndarray]], None]) -> Message:
    model = sent.model()
    change(model)
    return sent.full_weights(model)


def _first_tensor(model: dict[str, np.ndarray]) -> str:
    return next(iter(model))


# (name, corruption, fragment of the stored reason)
CASES: list[tuple[str, Callable[[Sent], Message], str]] = [
    # shapes and dtypes
    ("delta too long", lambda s: s.with_delta(np.zeros(s.dim + 3, np.float32)),
     "delta shape is"),
    ("delta too short", lambda s: s.with_delta(s.delta[:-1]), "delta shape is"),
    ("delta float64", lambda s: s.with_delta(s.delta.astype(np.float64)),
     "delta dtype is float64"),
    ("delta int32", lambda s: s.with_delta(np.ones(s.dim, np.int32)), "delta dtype is int32"),
    ("delta float16", lambda s: s.with_delta(s.delta.astype(np.float16)),
     "delta dtype is float16"),
    ("delta big-endian", lambda s: s.with_delta(s.delta.astype(">f4")), "delta dtype is >f4"),
    # values
    ("delta NaN", lambda s: s.with_delta(np.where(np.arange(s.dim) == 7, np.nan, s.delta)
                                         .astype(np.float32)), "delta has 1 NaN/Inf values"),
    ("delta Inf", lambda s: s.with_delta(np.full(s.dim, -np.inf, np.float32)),
     "NaN/Inf values"),
    ("delta huge norm", lambda s: s.with_delta(s.delta + np.float32(MAX_NORM)),
     "exceeds max_norm"),
    ("delta norm overflows", lambda s: s.with_delta(np.full(s.dim, 1e30, np.float32)),
     "delta norm overflows float32"),
    # num-examples
    ("examples zero", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: 0}),
     "num-examples must be a positive integer, got 0"),
    ("examples negative", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: -7}),
     "num-examples must be a positive integer, got -7"),
    ("examples missing", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: None}),
     "reply metrics lack 'num-examples'"),
    ("examples fractional", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: 2.5}),
     "num-examples must be a positive integer, got 2.5"),
    ("examples NaN", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: float("nan")}),
     "num-examples must be a positive integer, got nan"),
    ("examples a list", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: [5]}),
     "num-examples must be a positive integer, got [5]"),
    ("examples beyond int64", lambda s: s.with_metrics(**{MetricKey.NUM_EXAMPLES: 2**63}),
     "num-examples 9223372036854775808 does not fit an int64"),
    # model version
    ("base version from the future",
     lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: 2}),
     "trained from model version 2, but the client was sent version 1"),
    ("base version from the past",
     lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: 0}),
     "trained from model version 0, but the client was sent version 1"),
    ("base version beyond int64",
     lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: 2**70}),
     f"trained from model version {2**70}, but the client was sent version 1"),
    ("base version missing", lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: None}),
     "delta reply lacks an integer 'fedring.base-version'"),
    ("base version float", lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: 1.0}),
     "delta reply lacks an integer 'fedring.base-version'"),
    # replays and identities
    ("round 1 content replayed",
     lambda s: Message(s.first.content, reply_to=s.msg),
     "trained from model version 0, but the client was sent version 1"),
    ("round 1 message replayed", lambda s: s.first, "which awaits no reply (a duplicate or a "
                                                    "replay)"),
    ("impersonates node 1", lambda s: s.forged(s.honest, src_node_id=1),
     "says it comes from node 1"),
    # bytes
    ("npy truncated", lambda s: s.with_delta_bytes(npy_array(s.delta).data[:-5]),
     "array payload has"),
    ("npy oversized", lambda s: s.with_delta_bytes(npy_array(s.delta).data + bytes(64)),
     "array payload has"),
    ("npy header only", lambda s: s.with_delta_bytes(npy_array(s.delta[:0]).data),
     "delta shape is (0,)"),
    ("not npy at all", lambda s: s.with_delta_bytes(b"\x00garbage" * 9), "malformed .npy array"),
    ("npy negative dimensions",
     lambda s: s.with_delta_bytes(_npy({"descr": "<f4", "fortran_order": False,
                                        "shape": (-1, -s.dim)}, s.delta.tobytes())),
     "negative dimension"),
    ("npy zero-size items",
     lambda s: s.with_delta_bytes(_npy({"descr": "|V0", "fortran_order": False,
                                        "shape": (s.dim,)}, b"")),
     "unsupported .npy array"),
    ("npy object dtype",
     lambda s: s.with_delta_bytes(_npy({"descr": "|O", "fortran_order": False,
                                        "shape": (1,)}, bytes(8))),
     "unsupported .npy array"),
    ("npy fortran order",
     lambda s: s.with_delta_bytes(_npy({"descr": "<f4", "fortran_order": True,
                                        "shape": (1, s.dim)}, s.delta.tobytes())),
     "unsupported .npy array (fortran=True"),
    ("unknown serialization", lambda s: s.with_delta_bytes(s.delta.tobytes(), "torch.save"),
     "array serialization 'torch.save' is not supported"),
    # records and keys
    ("extra array in the delta record",
     lambda s: s.reply(delta=ArrayRecord({"delta": npy_array(s.delta),
                                          "bias": npy_array(s.delta[:3])})),
     "delta record has 2 arrays, expected 1"),
    ("unknown config record", lambda s: s.reply(note=ConfigRecord({"hello": "world"})),
     "delta reply has unexpected records ['note']"),
    ("second array record", lambda s: s.reply(arrays=delta_record(s.delta)),
     "delta reply has unexpected records ['arrays']"),
    ("delta is a config record", lambda s: s.reply(delta=ConfigRecord({"delta": b"x"})),
     "reply has no 'delta' array"),
    ("metrics missing", lambda s: s.reply(metrics=None), "reply has 0 metric records"),
    ("metrics twice", lambda s: s.reply(more=MetricRecord({"x": 1.0})),
     "reply has 2 metric records"),
    ("metric NaN", lambda s: s.with_metrics(train_loss=float("nan")),
     "metric 'train_loss' is not a finite number: nan"),
    ("metric beyond float64", lambda s: s.with_metrics(train_loss=10**400),
     "metric 'train_loss' is not a finite number"),
    ("empty reply", lambda s: Message(RecordDict(), reply_to=s.msg),
     "reply has 0 metric records"),
    ("wrong message type", lambda s: s.forged(s.honest, message_type="evaluate"),
     "reply has message type 'evaluate', expected a 'train' reply"),
    # stock Flower replies (full weights) that do not fit the model
    ("weights of the wrong shape",
     lambda s: _wrong_model(s, lambda m: m.update({_first_tensor(m): np.zeros(3, np.float32)})),
     "has shape (3,), layout expects"),
    ("weights with an unknown tensor",
     lambda s: _wrong_model(s, lambda m: m.update(extra=np.zeros(2, np.float32))),
     "missing none; unexpected extra"),
    ("weights of an integer dtype",
     lambda s: _wrong_model(s, lambda m: m.update({_first_tensor(m):
                                                   m[_first_tensor(m)].astype(np.int64)})),
     "expected a float type"),
]
NODE_OF = {name: HONEST + 1 + i for i, (name, _, _) in enumerate(CASES)}


@dataclass
class StoredRound1:
    """What the store holds about round 1, read while the run goes on."""

    round: Any
    updates: list[Any]
    checkpoint: Any

    @classmethod
    def read(cls, db_url: str, *, checkpoint: bool) -> StoredRound1:
        """Round 1's records; its checkpoint too once a later round is recorded (the store
        writes checkpoints in the background, before its next write)."""
        with Store(db_url) as store:
            (run,) = store.list_runs()
            run_id = run.run_id
            rnd = next(r for r in store.rounds(run_id) if r.round == 1)
            return cls(rnd, store.updates(run_id, round=1),
                       store.load_checkpoint(run_id, round=1) if checkpoint else None)


def well_formed_reply(msg: Message, pid: int, dim: int) -> Message:
    """A valid delta reply, without training: what the server sees of an honest client."""
    config = msg.content["config"]
    rng = np.random.default_rng([pid, config["server-round"]])
    delta = (0.01 * rng.standard_normal(dim)).astype(np.float32)
    metrics = MetricRecord({MetricKey.NUM_EXAMPLES: 10 + pid, "train_loss": 0.5,
                            MetricKey.BASE_VERSION: config[ConfigKey.VERSION]})
    return Message(RecordDict({"delta": delta_record(delta), "metrics": metrics}),
                   reply_to=msg)


@dataclass
class HostileApp:
    """Nodes 1..3 run fedring's ClientApp; the others send well-formed replies, except in
    round 2, where each corrupts one field of its reply."""

    dim: int
    db_url: str
    first: dict[int, Message] = field(default_factory=dict)
    honest_deltas: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)
    stored: dict[int, StoredRound1] = field(default_factory=dict)  # by the round it was read

    def __call__(self, msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        rnd = msg.content["config"]["server-round"]
        if rnd > 1 and rnd not in self.stored:  # all of round rnd - 1 is stored by now
            self.stored[rnd] = StoredRound1.read(self.db_url, checkpoint=rnd > 2)
        if pid < HONEST:
            reply = client_app(msg, context)
            if rnd == HOSTILE_ROUND:
                self.honest_deltas[pid] = (npy_view(reply.content["delta"]["delta"]),
                                           int(reply.content["metrics"][MetricKey.NUM_EXAMPLES]))
            return reply
        honest = well_formed_reply(msg, pid, self.dim)
        if rnd == 1:
            self.first[pid] = honest
        if rnd != HOSTILE_ROUND:
            return honest
        _, corrupt, _ = CASES[pid - HONEST]
        return corrupt(Sent(msg=msg, honest=honest, first=self.first[pid], dim=self.dim))


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class CorpusRun:
    summary: dict[str, Any]
    store: Store
    app: HostileApp
    models: list[np.ndarray]  # the model evaluated after each round (index 0: initial)
    logged: list[str]


def run_hostile(config: dict[str, Any], app: Any, db_url: str,
                models: list[np.ndarray]) -> dict[str, Any]:
    """fedring's ServerApp over the in-process engine, as ``fedring simulate`` runs it."""
    result: dict[str, Any] = {}

    def task_builder(cfg: dict[str, Any]) -> Any:
        task = build_task(cfg)
        evaluate = task.evaluate
        task.evaluate = lambda p: (models.append(p.copy()), evaluate(p))[1]
        return task

    server_app = make_server_app(task_builder, config_from_run_config, config=config,
                                 store_url=db_url, on_summary=result.update)
    grid = InProcessGrid(app, config["federation"]["clients"])
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                             run_config={}))
    return result


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> CorpusRun:
    config = load_scenario("default", [
        f"federation.clients={HONEST + len(CASES)}", "federation.rounds=3",
        "federation.round_timeout_s=1.0", "federation.checkpoint_every=1",
        "data.partitioner=iid", "train.local_epochs=1", f"aggregation.max_norm={MAX_NORM}"])
    dim = build_task(config).initial_params()[1].dim
    db_url = f"sqlite:///{tmp_path_factory.mktemp('hostile') / 'fedring.db'}"
    app = HostileApp(dim, db_url)
    models: list[np.ndarray] = []
    logged = _Messages()
    logger = logging.getLogger("fedring")
    logger.addHandler(logged)
    try:
        summary = run_hostile(config, app, db_url, models)
    finally:
        logger.removeHandler(logged)
    store = Store(db_url)
    yield CorpusRun(summary, store, app, models, logged.lines)
    store.close()


@pytest.mark.parametrize(("name", "fragment"), [(c[0], c[2]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_reply_is_rejected_with_a_stored_and_logged_reason(corpus, name, fragment):
    node = str(NODE_OF[name])
    run_id = corpus.summary["run_id"]
    mine = [u for _, u in corpus.store.updates(run_id, round=HOSTILE_ROUND)
            if u.client_id == node]
    rejected = [u for u in mine if u.fate == "rejected"]
    assert len(rejected) == 1 and fragment in rejected[0].reason, mine
    assert all(u.fate != "accepted" for u in mine)
    logged = f"round {HOSTILE_ROUND}: rejected client {node}: {rejected[0].reason}"
    assert logged in corpus.logged
    # The same client is accepted again in the next round: one bad reply costs one update.
    after = [u for _, u in corpus.store.updates(run_id, round=HOSTILE_ROUND + 1)
             if u.client_id == node]
    assert [u.fate for u in after] == ["accepted"]


def test_the_round_goes_on_with_the_honest_updates_only(corpus):
    run_id = corpus.summary["run_id"]
    assert corpus.summary["status"] == "completed" and corpus.summary["versions"] == 3
    rounds = {r.round: r for r in corpus.store.rounds(run_id)}
    hostile = rounds[HOSTILE_ROUND]
    assert (hostile.status, hostile.num_accepted, hostile.num_rejected) == (
        "completed", HONEST, len(CASES))
    assert hostile.num_dropped == 1  # the node whose reply was a replay never answered
    accepted = sorted(int(u.client_id) for _, u in corpus.store.updates(run_id, round=2)
                      if u.fate == "accepted")
    assert accepted == list(range(1, HONEST + 1))
    # The applied step is the example-weighted mean of the honest deltas, nothing else.
    deltas = corpus.app.honest_deltas
    weights = np.array([n for _, n in deltas.values()], dtype=np.float64)
    expected = sum(w * d.astype(np.float64) for w, (d, _) in zip(weights, deltas.values(),
                                                                  strict=True)) / weights.sum()
    step = corpus.models[HOSTILE_ROUND].astype(np.float64) - corpus.models[HOSTILE_ROUND - 1]
    np.testing.assert_allclose(step, expected, rtol=1e-4, atol=1e-6)


def test_nothing_stored_before_or_after_is_lost(corpus):
    run_id = corpus.summary["run_id"]
    clients = HONEST + len(CASES)
    rounds = {r.round: r for r in corpus.store.rounds(run_id)}
    assert sorted(rounds) == [0, 1, 2, 3]
    for rnd in (1, 3):
        assert (rounds[rnd].status, rounds[rnd].num_accepted, rounds[rnd].num_rejected) == (
            "completed", clients, 0)
        fates = [u.fate for _, u in corpus.store.updates(run_id, round=rnd)]
        assert fates == ["accepted"] * clients
    # Round 1 as stored before the hostile round, and after it: the same; its checkpoint
    # (sha256-checked when read) holds the model of round 1.
    before, after = corpus.app.stored[HOSTILE_ROUND], corpus.app.stored[HOSTILE_ROUND + 1]
    assert before.round == after.round == rounds[1]
    assert before.updates == after.updates == corpus.store.updates(run_id, round=1)
    assert after.checkpoint.model_version == 1
    np.testing.assert_array_equal(after.checkpoint.params, corpus.models[1])
    for rnd in (2, 3):  # the store keeps the two newest checkpoints
        checkpoint = corpus.store.load_checkpoint(run_id, round=rnd)  # sha256-checked
        assert checkpoint.model_version == rnd
        np.testing.assert_array_equal(checkpoint.params, corpus.models[rnd])


# ---------------------------------------------------------------- asynchronous drivers

ASYNC_CASES = {  # node -> (corruption of a reply to a task at model version >= 1, reason)
    4: (lambda s: s.with_metrics(**{MetricKey.BASE_VERSION: 0}),
        "reply says it trained from model version 0, but the client was sent version"),
    5: (lambda s: Message(s.first.content, reply_to=s.msg),
        "reply says it trained from model version 0, but the client was sent version"),
    6: (lambda s: s.forged(s.honest, src_node_id=1), "says it comes from node 1"),
}


@dataclass
class AsyncHostileApp:
    """Nodes 1..3 send well-formed replies; nodes 4..6 misbehave once the model moved on."""

    dim: int
    first: dict[int, Message] = field(default_factory=dict)

    def __call__(self, msg: Message, context: Context) -> Message:
        node = context.node_config["partition-id"] + 1
        honest = well_formed_reply(msg, node - 1, self.dim)
        self.first.setdefault(node, honest)
        if node not in ASYNC_CASES or msg.content["config"][ConfigKey.VERSION] == 0:
            return honest
        corrupt, _ = ASYNC_CASES[node]
        return corrupt(Sent(msg=msg, honest=honest, first=self.first[node], dim=self.dim))


@pytest.mark.parametrize("kind", ["fedasync", "fedbuff"])
def test_async_drivers_reject_wrong_versions_replays_and_impersonation(kind, tmp_path,
                                                                       caplog):
    config = load_scenario("default", [
        "federation.clients=6", "federation.rounds=12", "federation.checkpoint_every=1",
        "data.partitioner=iid", f"driver.kind={kind}", "driver.buffer_size=2"])
    dim = build_task(config).initial_params()[1].dim
    db_url = f"sqlite:///{tmp_path / 'fedring.db'}"
    with caplog.at_level(logging.WARNING, logger="fedring"):
        summary = run_hostile(config, AsyncHostileApp(dim), db_url, [])
    assert (summary["status"], summary["versions"]) == ("completed", 12)
    with Store(db_url) as store:
        updates = [u for _, u in store.updates(summary["run_id"])]
        rounds = store.rounds(summary["run_id"])
    # Every aggregate was applied (an extra "aborted" round may hold what came after).
    assert [r.status for r in rounds[1:13]] == ["completed"] * 12
    for node, (_, reason) in ASYNC_CASES.items():
        mine = [u for u in updates if u.client_id == str(node)]
        rejected = [u for u in mine if u.fate == "rejected"]
        assert rejected and all(reason in u.reason for u in rejected), mine
        assert sum(u.fate == "accepted" for u in mine) <= 1  # only its task at version 0
        assert any(f"rejected client {node}: " in m and reason in m for m in caplog.messages)
    honest = [u for u in updates if int(u.client_id) <= 3]
    assert {u.fate for u in honest} <= {"accepted", "dropped"}
