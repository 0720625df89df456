"""Secure federated evaluation: the server learns the clients' evaluation totals only.

Real ClientApp (training and evaluation of the default task), the in-process engine and
the SecAgg+ stages: the round's federated accuracy and loss equal the example-weighted
means of the figures each client gives a plain evaluate message, up to the fixed-point
step; no reply the server pulls carries a client's figure; a client that vanishes
mid-session is recorded dropped and the totals are the survivors'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.app import FedringClient, refuse_unusable_messages
from client.protocol.evaluation import (
    ClientEvaluation,
    EvalKey,
    evaluate_config,
    read_evaluation,
)
from client.protocol.keys import ConfigKey, MetricKey, RecordName
from client.protocol.secagg import SecAggKey, SecAggRecord
from client.protocol.updates import model_record
from client.secure_client import MIN_SURVIVORS_KEY, register_secagg
from privacy.secagg.eval_words import STEP, EvalWords
from privacy.secagg.messages import read_header
from privacy.secagg.quantize import LOSS_RANGE
from privacy.secagg.stages import MsgType
from server.reporter import LogReporter
from server.rounds import RunContext
from server.scenario import ServerScenario
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import EvalStart, SecAggSession
from server.secure_evaluation import CLIPPED, run_secure_evaluation, secure_evaluate
from server.store import Store
from simulations.apps import build_task, client_app, spec_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.module_task import make_task
from tests.recording_grid import RecordsReplies
from tests.weak_secagg import WeakSettings

CLIENTS = 5
BN_TASK = str(Path(__file__).with_name("bn_cnn_task.py"))
SECURE = ["secagg.enabled=true", "federation.secure_evaluation=true",
          "federation.evaluate_fraction=1"]
FIGURE_KEYS = {MetricKey.NUM_EXAMPLES, *EvalKey.__dict__.values(), "loss", "accuracy",
               "train_loss"}

def secure_app(personal: Callable[[int], tuple[float, float] | None] | None = None
               ) -> ClientApp:
    """fedring's ClientApp; with ``personal`` (node id -> its own model's accuracy and
    loss, or None) the same app whose evaluation adds those figures."""
    if personal is None:
        return client_app
    client = FedringClient(make_task, spec_from_run_config)

    def evaluation(msg: Message, context: Context) -> ClientEvaluation:
        figures, own = client.evaluation(msg, context), personal(int(context.node_id))
        if own is None:
            return figures
        acc, loss = own
        return ClientEvaluation(figures.num_examples, figures.loss, figures.accuracy,
                                loss_personal=loss, accuracy_personal=acc)

    app = ClientApp(mods=[refuse_unusable_messages])
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    register_secagg(app, client.local_update, evaluation)
    return app


class RecordingGrid(RecordsReplies, InProcessGrid):
    """The in-process engine, keeping every reply the server pulls."""


def figures_in_the_clear(reply: Message) -> list[str]:
    """The per-client figures a reply carries outside the masked vector."""
    if reply.has_error():
        return []
    return [f"{name}.{key}" for name, record in reply.content.items()
            if isinstance(record, MetricRecord | ConfigRecord)
            for key in record if key in FIGURE_KEYS]


@contextmanager
def context(app: Callable, overrides: list[str], tmp_path) -> Iterator[RunContext]:
    config = load_scenario("default", [f"federation.clients={CLIENTS}", *overrides])
    scenario = ServerScenario.of(config)
    store = Store(f"sqlite:///{tmp_path / 'e.db'}")
    try:
        yield RunContext(RecordingGrid(app, CLIENTS), scenario=scenario,
                         task=build_task(config),
                         pipeline=scenario.aggregation.build(seed=scenario.seed, secure=True),
                         store=store, reporter=LogReporter())
    finally:
        store.close()


def plain_figures(ctx: RunContext, app: Callable, rnd: int) -> dict[int, ClientEvaluation]:
    """Each node's figures for the current model, from the plain evaluate path of a
    separate engine (the figures a plain evaluation round would see)."""
    grid = InProcessGrid(app, CLIENTS)
    config = evaluate_config(rnd, ctx.state.version, ctx.task_json, ctx.seed)
    out = {}
    for node in range(1, CLIENTS + 1):
        msg = Message(RecordDict({RecordName.ARRAYS: ctx.model_record(),
                                  RecordName.CONFIG: config}), node, "evaluate", group_id="p")
        reply = next(iter(grid.pull_messages(grid.push_messages([msg]))))
        out[node] = read_evaluation(reply.content[RecordName.METRICS])
    return out


def weighted(figures: dict[int, ClientEvaluation], nodes) -> tuple[float, float]:
    e = sum(figures[n].num_examples for n in nodes)
    return (sum(figures[n].num_examples * figures[n].accuracy for n in nodes) / e,
            sum(figures[n].num_examples * figures[n].loss for n in nodes) / e)


def trained(ctx: RunContext) -> None:
    """Move the model off its initial state (so the figures are not all alike)."""
    rng = np.random.default_rng(3)
    ctx.state.params = ctx.state.params + 0.05 * rng.standard_normal(
        ctx.state.params.shape).astype(np.float32)
    ctx.state.version = 1


def test_the_federated_accuracy_is_the_weighted_mean_and_no_client_figure_is_pulled(
        tmp_path):
    app = secure_app()
    with context(app, SECURE, tmp_path) as ctx:
        trained(ctx)
        records, metrics = secure_evaluate(ctx, "run-a", 1, list(range(1, CLIENTS + 1)))
        figures = plain_figures(ctx, app, 1)
        acc, loss = weighted(figures, figures)
        n = CLIENTS
        total = sum(f.num_examples for f in figures.values())
        assert metrics["federated_clients"] == n
        # each client rounds examples * accuracy (and * loss) to STEP: n/2 steps at most
        assert abs(metrics["federated_accuracy"] - acc) <= n * STEP / 2 / total
        assert abs(metrics["federated_loss"] - loss) <= n * STEP / 2 / total
        assert metrics[CLIPPED] == 0
        assert len({round(f.accuracy, 6) for f in figures.values()}) > 1  # not all alike
        # only the totals: no spread figure, no per-client figure
        assert not any(k.endswith(("_p10", "_min", "_std", "_mean", "_p90")) for k in metrics)
        assert "federated_accuracy_personal" not in metrics
        assert [(r.client_id, r.fate) for r in records] == [
            (str(i), "accepted") for i in range(1, n + 1)]
        assert all(r.accuracy is None and r.loss is None and r.num_examples is None
                   for r in records)
        replies = ctx.grid.inner.replies
        assert len(replies) == 3 * n  # the merged flow's three exchanges, every client
        assert {r.metadata.message_type for r in replies} == {"evaluate.secagg",
                                                              "query.secagg"}
        assert [leak for r in replies if (leak := figures_in_the_clear(r))] == []


def vanishing(app: Callable, node: int, kind: MsgType) -> Callable:
    """``app``, but ``node`` vanishes when it gets a ``kind`` protocol message."""

    def flaky(msg: Message, context: Context) -> Message:
        record = msg.content.get(SecAggRecord.PROTOCOL)
        if int(context.node_id) == node and isinstance(record, ConfigRecord) \
                and read_header(record[SecAggKey.MSG]).kind is kind:
            raise ConnectionError("client vanished")
        return app(msg, context)

    return flaky


def test_a_client_vanishing_mid_session_is_dropped_and_the_totals_are_the_survivors(
        tmp_path):
    app = secure_app()
    # it vanishes at PUBLIC_KEYS (the merged flow's shares stage): the others mask again
    with context(vanishing(app, 2, MsgType.PUBLIC_KEYS), SECURE, tmp_path) as ctx:
        trained(ctx)
        result = run_secure_evaluation(ctx, "run-b", 3, list(range(1, CLIENTS + 1)))
        figures = plain_figures(ctx, app, 3)
    survivors = [1, 3, 4, 5]
    assert result.outcome.status == "completed"
    assert result.outcome.survivors == survivors
    fates = {r.client_id: (r.fate, r.reason) for r in result.records}
    assert fates["2"][0] == "dropped"
    assert fates["2"][1].startswith("dropped at stage share_keys: ")
    assert all(fates[str(n)] == ("accepted", None) for n in survivors)
    acc, loss = weighted(figures, survivors)
    total = sum(figures[n].num_examples for n in survivors)
    assert result.metrics["federated_clients"] == len(survivors)
    assert abs(result.metrics["federated_accuracy"] - acc) <= len(survivors) * STEP / total
    assert abs(result.metrics["federated_loss"] - loss) <= len(survivors) * STEP / total
    everyone = weighted(figures, figures)
    assert abs(result.metrics["federated_loss"] - everyone[1]) > 10 * STEP  # not all five
    assert result.outcome.session_record()["dropouts"]["share_keys"] == [2]


def test_own_model_figures_and_clipped_losses_travel_as_totals(tmp_path):
    def personal(node: int) -> tuple[float, float]:  # node 1's own loss is out of range
        return node / 10, (1000.0 if node == 1 else float(node))

    app = secure_app(personal)
    with context(app, SECURE, tmp_path) as ctx:
        trained(ctx)
        records, metrics = secure_evaluate(ctx, "run-c", 2, list(range(1, CLIENTS + 1)))
        figures = plain_figures(ctx, app, 2)
    examples = {n: f.num_examples for n, f in figures.items()}
    total = sum(examples.values())
    assert metrics[CLIPPED] == 1  # the one loss above LOSS_RANGE
    assert metrics["federated_accuracy_personal"] == pytest.approx(
        sum(e * n / 10 for n, e in examples.items()) / total, abs=CLIENTS * STEP / total)
    kept = {n: min(personal(n)[1], LOSS_RANGE) for n in examples}  # clipped to the range
    assert metrics["federated_loss_personal"] == pytest.approx(
        sum(examples[n] * kept[n] for n in examples) / total, abs=CLIENTS * STEP / total)
    assert metrics["federated_accuracy"] == pytest.approx(weighted(figures, figures)[0],
                                                          abs=CLIENTS * STEP / total)
    assert all(r.fate == "accepted" and r.accuracy_personal is None for r in records)


def test_own_model_figures_need_every_survivor(tmp_path):
    app = secure_app(lambda node: (0.5, 1.0) if node != 3 else None)
    with context(app, SECURE, tmp_path) as ctx:
        _, metrics = secure_evaluate(ctx, "run-d", 1, list(range(1, CLIENTS + 1)))
    assert metrics["federated_clients"] == CLIENTS and "federated_accuracy" in metrics
    assert not any(key.endswith("_personal") for key in metrics)


def counting_app(evaluated: list[int]) -> ClientApp:
    """Clients that count their evaluations (fixed figures), behind fedring's refusal mod."""

    def evaluation(msg: Message, context: Context) -> ClientEvaluation:
        evaluated.append(int(context.node_id))
        return ClientEvaluation(num_examples=10, loss=1.0, accuracy=0.5)

    def no_training(msg: Message, context: Context) -> Any:
        raise AssertionError("an evaluation session trains nothing")

    app = ClientApp(mods=[refuse_unusable_messages])
    register_secagg(app, no_training, evaluation)
    return app


@pytest.mark.parametrize(("n", "k", "t", "fragment"), [
    (4, 1, 1, "k = 1 neighbours is below the minimum 3"),
    (6, 2, 2, "k = 2 neighbours is below the minimum 3"),
    (5, 4, 2, "threshold t = 2 is not more than half of k = 4"),
    (2, 1, 1, "2 participants can never give the 3")])
def test_every_client_refuses_an_evaluation_session_below_policy_before_evaluating(
        n, k, t, fragment):
    evaluated: list[int] = []
    settings = WeakSettings(enabled=True)
    object.__setattr__(settings, "forced", (k, t))
    session = SecAggSession(InProcessGrid(counting_app(evaluated), n), settings, "examples", 9,
                            5.0, 0.001)
    out = session.run(list(range(1, n + 1)), 1,
                      EvalStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}),
                                EvalWords.for_sum(n, 32)))
    assert (out.k, out.t) == (k, t) and out.status == "aborted"
    assert evaluated == []  # refused before evaluating
    for record in out.update_records():
        assert record.fate == "dropped"
        assert record.reason.startswith("dropped at stage advertise_keys: evaluate.secagg "
                                        "message refused: session below the "
                                        "secure-aggregation policy: ")
        assert fragment in record.reason


def test_clients_refuse_to_unmask_fewer_survivors_than_their_own_minimum(tmp_path):
    """Every node wants sums of all five; one vanishes before sharing keys: the server
    (minimum 3) asks to unmask four, every client refuses, no total is revealed."""
    evaluated: list[int] = []
    app = vanishing(counting_app(evaluated), 2, MsgType.PUBLIC_KEYS)
    with context(app, SECURE, tmp_path) as ctx:
        for node_context in ctx.grid.inner._contexts.values():
            node_context.node_config[MIN_SURVIVORS_KEY] = CLIENTS
        records, metrics = secure_evaluate(ctx, "run-e", 1, list(range(1, CLIENTS + 1)))
        replies = ctx.grid.inner.replies
    assert sorted(evaluated) == list(range(1, CLIENTS + 1))
    assert metrics == {}
    assert all(r.fate != "accepted" for r in records)
    unmask = [r for r in replies if r.has_error() and "unmask request refused" in r.error.reason]
    assert len(unmask) == CLIENTS - 1  # the four survivors, each
    assert all("fewer than the minimum 5" in r.error.reason for r in unmask)


def test_a_cohort_below_min_survivors_is_rejected_with_the_reason(tmp_path):
    app = secure_app()
    with context(app, SECURE, tmp_path) as ctx:
        records, metrics = secure_evaluate(ctx, "run-f", 1, [1, 2])
    assert metrics == {}
    assert [r.fate for r in records] == ["rejected", "rejected"]
    assert all(r.reason.startswith("secure evaluation aborted: ") for r in records)
    assert all("secagg.min_survivors = 3" in r.reason for r in records)


def test_totals_no_honest_client_could_send_are_rejected_not_recorded(tmp_path, monkeypatch):
    """A client whose words claim more correct answers than examples (each word within
    range, so nothing wraps): the survivors' sum is rejected with the reason."""
    encode = EvalWords.encode

    def lying(words: EvalWords, examples: float, *args: Any) -> np.ndarray:
        out = encode(words, examples, *args)
        if examples == 10:  # the liar's own count
            out[:] = words.level
        return out

    monkeypatch.setattr(EvalWords, "encode", lying)

    def evaluation(msg: Message, context: Context) -> ClientEvaluation:
        liar = int(context.node_id) == 1
        return ClientEvaluation(num_examples=10 if liar else 20, loss=1.0, accuracy=0.5)

    app = ClientApp(mods=[refuse_unusable_messages])
    register_secagg(app, lambda msg, context: None, evaluation)  # type: ignore[arg-type]
    with context(app, SECURE, tmp_path) as ctx:
        records, metrics = secure_evaluate(ctx, "run-g", 1, list(range(1, CLIENTS + 1)))
    assert metrics == {}
    assert {r.fate for r in records} == {"rejected"}
    assert all(r.reason.startswith("secure evaluation totals rejected: ") for r in records)


def test_stat_words_of_many_clients_sum_to_their_totals_at_a_small_modulus():
    """At 8 bits with 20 clients each word is below 13: every number spans many digits,
    and the digit sums still decode to the exact totals."""
    rng = np.random.default_rng(5)
    n, bits = 20, 8
    words = EvalWords.for_sum(n, bits)
    rows = [(int(rng.integers(1, 5000)), float(rng.random()), float(rng.random() * 5),
             float(rng.random()), float(rng.random() * 5)) for _ in range(n)]
    total = sum(words.encode(*row).astype(object) for row in rows)
    assert max(total) < 1 << bits  # the sum cannot wrap
    got = words.decode(np.array(total, dtype=np.uint64))
    e = sum(r[0] for r in rows)
    assert (got.examples, got.personal, got.clipped) == (e, n, 0)
    for value, column in ((got.correct, 1), (got.loss_sum, 2), (got.correct_personal, 3),
                          (got.loss_sum_personal, 4)):
        assert abs(value - sum(r[0] * r[column] for r in rows)) <= n * STEP / 2


def final_model_figures(config: dict[str, Any], params: np.ndarray, app: Callable,
                        rnd: int, version: int) -> dict[int, ClientEvaluation]:
    """Each node's plain evaluate figures for ``params``."""
    task = build_task(config)
    _, layout = task.initial_params()
    grid = InProcessGrid(app, CLIENTS)
    cfg = evaluate_config(rnd, version, json.dumps(task.task_spec(), sort_keys=True),
                          config["seed"])
    out = {}
    for node in range(1, CLIENTS + 1):
        msg = Message(RecordDict({RecordName.ARRAYS: model_record(layout, params),
                                  RecordName.CONFIG: cfg}), node, "evaluate", group_id="p")
        reply = next(iter(grid.pull_messages(grid.push_messages([msg]))))
        out[node] = read_evaluation(reply.content[RecordName.METRICS])
    return out


RUN = [f"federation.clients={CLIENTS}", "federation.rounds=2", "train.local_epochs=1",
       "secagg.enabled=true", "federation.evaluate_fraction=1"]


def test_a_secure_run_with_secure_evaluation_records_only_the_totals(run_inprocess, store):
    app = secure_app()
    grid = RecordingGrid(app, CLIENTS)
    config = load_scenario("default", [*RUN, "federation.secure_evaluation=true"])
    summary = run_inprocess(config, grid=grid)
    assert summary["status"] == "completed" and summary["versions"] == 2
    run_id = summary["run_id"]
    last = store.rounds(run_id)[2]
    params = store.load_checkpoint(run_id, round=2).params
    figures = final_model_figures(config, params, app, 2, last.model_version)
    acc, loss = weighted(figures, figures)
    total = sum(f.num_examples for f in figures.values())
    assert last.metrics["federated_clients"] == CLIENTS
    assert abs(last.metrics["federated_accuracy"] - acc) <= CLIENTS * STEP / 2 / total
    assert abs(last.metrics["federated_loss"] - loss) <= CLIENTS * STEP / 2 / total
    assert not any(k.startswith("federated_accuracy_") for k in last.metrics)  # no spread
    for rnd in (1, 2):
        records = [r for _, r in store.evaluations(run_id, round=rnd)]
        assert sorted(r.client_id for r in records) == [str(i) for i in range(1, 6)]
        assert all(r.fate == "accepted" and r.accuracy is None and r.num_examples is None
                   for r in records)
    kinds = {r.metadata.message_type for r in grid.replies}
    assert "evaluate" not in kinds and "evaluate.secagg" in kinds
    assert [leak for r in grid.replies if (leak := figures_in_the_clear(r))] == []


def test_plain_evaluation_under_secagg_still_works_and_is_per_client(run_inprocess, store):
    """Without ``secure_evaluation`` the figures come back per client, in the clear."""
    app = secure_app()
    grid = RecordingGrid(app, CLIENTS)
    summary = run_inprocess(load_scenario("default", RUN), grid=grid)
    assert summary["status"] == "completed"
    records = [r for _, r in store.evaluations(summary["run_id"], round=2)]
    assert len(records) == CLIENTS
    assert all(r.fate == "accepted" and r.num_examples and r.accuracy is not None
               for r in records)
    metrics = store.rounds(summary["run_id"])[2].metrics
    assert "federated_accuracy_p10" in metrics and "federated_accuracy_min" in metrics
    plain = [r for r in grid.replies if r.metadata.message_type == "evaluate"]
    assert len(plain) == 2 * CLIENTS
    assert all(figures_in_the_clear(r) for r in plain)  # each carries its client's figures
    training = [r for r in grid.replies if r.metadata.message_type != "evaluate"]
    assert [leak for r in training if (leak := figures_in_the_clear(r))] == []


def test_fedbn_clients_send_their_own_models_figures_as_totals(run_inprocess, store):
    """A batch-norm task with FedBN: after the run, each node's plain figures (its own
    batch norm from its node state) give the same weighted means as the secure totals."""
    app = secure_app()
    grid = RecordingGrid(app, CLIENTS)
    config = load_scenario("default", [
        f"task.module={BN_TASK}", "task.client_test_fraction=0.2", "aggregation.local_buffers=true",
        *RUN, "federation.rounds=1", "federation.secure_evaluation=true"])
    summary = run_inprocess(config, grid=grid)
    assert summary["status"] == "completed"
    metrics = store.rounds(summary["run_id"])[1].metrics
    task = build_task(config)
    _, layout = task.initial_params()
    cfg = evaluate_config(1, 1, json.dumps(task.task_spec(), sort_keys=True), config["seed"],
                          local_buffers=True)
    params = store.load_checkpoint(summary["run_id"], round=1).params
    figures = {}
    for node in range(1, CLIENTS + 1):  # the run's own nodes, with their node state
        msg = Message(RecordDict({RecordName.ARRAYS: model_record(layout, params),
                                  RecordName.CONFIG: cfg}), node, "evaluate", group_id="p")
        reply = next(iter(grid.pull_messages(grid.push_messages([msg]))))
        figures[node] = read_evaluation(reply.content[RecordName.METRICS])
    assert all(f.personal for f in figures.values())
    total = sum(f.num_examples for f in figures.values())
    step = CLIENTS * STEP / 2 / total
    for key, of in (("federated_accuracy", lambda f: f.accuracy),
                    ("federated_loss", lambda f: f.loss),
                    ("federated_accuracy_personal", lambda f: f.accuracy_personal),
                    ("federated_loss_personal", lambda f: f.loss_personal)):
        expected = sum(f.num_examples * of(f) for f in figures.values()) / total
        assert abs(metrics[key] - expected) <= step, key
    assert metrics["federated_accuracy_personal"] != metrics["federated_accuracy"]


@pytest.mark.parametrize(("level", "refused"), [(2**30, True), (2**30 - 1, False)])
def test_clients_refuse_a_layout_whose_sum_could_wrap(level, refused):
    """Four clients at 32 bits: words up to 2^30 let the sum reach 2^32 and wrap, so every
    client refuses before evaluating; one less and the session completes."""
    evaluated: list[int] = []
    n = 4
    session = SecAggSession(InProcessGrid(counting_app(evaluated), n),
                            SecAggScenarioConfig(enabled=True), "examples", 9, 5.0, 0.001)
    out = session.run(list(range(1, n + 1)), 1,
                      EvalStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}),
                                EvalWords(level=level)))
    if refused:
        assert out.status == "aborted" and evaluated == []
        assert all("can wrap a 32-bit sum" in r.reason for r in out.update_records())
    else:
        assert out.status == "completed" and sorted(evaluated) == [1, 2, 3, 4]
        assert out.evaluation is not None and out.evaluation.examples == 40
