"""Federated evaluation end to end: the clients measure the global model on their own data,
each answer is checked and stored, and the round records the spread of their accuracies.

Runs go through the real in-process engine (``run_inprocess``) or the ``fedring`` command.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from server import cohort as cohort_module
from server.app import make_server_app
from server.spread import spread
from server.store import EvalRecord, Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

BASE = ["federation.clients=5", "federation.rounds=1", "train.local_epochs=1",
        "federation.evaluate_fraction=1"]


def config(*overrides: str) -> dict[str, Any]:
    return load_scenario("default", [*BASE, *overrides])


def answers(store: Store, run_id: str, rnd: int) -> dict[str, EvalRecord]:
    return {e.client_id: e for _, e in store.evaluations(run_id, round=rnd)}


def federated(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("federated_")
            and k != "federated_eval_s"}


# ---- the spread, against a computation written here


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


def _stats(accs: list[float], losses: list[float], counts: list[int]) -> dict[str, float]:
    total = sum(counts)
    mean = sum(accs) / len(accs)
    return {"loss": sum(v * n for v, n in zip(losses, counts, strict=True)) / total,
            "weighted": sum(a * n for a, n in zip(accs, counts, strict=True)) / total,
            "mean": mean, "std": math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs)),
            "p10": _percentile(accs, 10), "p90": _percentile(accs, 90), "min": min(accs)}


def test_spread_every_statistic_against_its_definition():
    accepted = [EvalRecord("1", "accepted", num_examples=10, loss=0.5, accuracy=0.9,
                           loss_personal=0.4, accuracy_personal=0.95),
                EvalRecord("2", "accepted", num_examples=30, loss=1.0, accuracy=0.6,
                           loss_personal=0.9, accuracy_personal=0.7),
                EvalRecord("3", "accepted", num_examples=5, loss=0.2, accuracy=1.0,
                           loss_personal=0.1, accuracy_personal=1.0),
                EvalRecord("4", "accepted", num_examples=55, loss=0.7, accuracy=0.75,
                           loss_personal=0.3, accuracy_personal=0.8)]
    others = [EvalRecord("5", "rejected", reason="NaN", num_examples=1000, loss=9.0,
                         accuracy=0.0),
              EvalRecord("6", "dropped", reason="late")]
    got = spread(accepted + others)
    counts = [10, 30, 5, 55]
    for personal, suffix in ((False, ""), (True, "_personal")):
        accs = [r.accuracy_personal if personal else r.accuracy for r in accepted]
        losses = [r.loss_personal if personal else r.loss for r in accepted]
        want = _stats(accs, losses, counts)
        assert got[f"federated_loss{suffix}"] == pytest.approx(want["loss"])
        assert got[f"federated_accuracy{suffix}"] == pytest.approx(want["weighted"])
        for stat in ("mean", "std", "p10", "p90", "min"):
            assert got[f"federated_accuracy{suffix}_{stat}"] == pytest.approx(want[stat]), stat
    assert got["federated_clients"] == 4
    # personal figures only when every accepted answer has them
    mixed = spread([*accepted, EvalRecord("7", "accepted", num_examples=1, loss=0.0,
                                          accuracy=0.5)])
    assert "federated_accuracy" in mixed and "federated_accuracy_personal" not in mixed
    assert spread(others) == {}


# ---- the rounds that evaluate, through the fedring command


@pytest.mark.slow
def test_evaluated_rounds_store_records_and_figures_and_the_json_line_has_them(tmp_path):
    db = f"sqlite:///{tmp_path / 'store.db'}"
    args = ["--clients", "4", "--rounds", "5", "--seed", "1", "--db", db, "--json",
            "--set", "train.local_epochs=1", "--set", "federation.evaluate_fraction=1",
            "--set", "federation.evaluate_every=2"]
    proc = subprocess.run([sys.executable, "-m", "simulations.cli", "simulate", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with Store(db) as store:
        rounds = {r.round: r for r in store.rounds(summary["run_id"])}
        evaluated = {rnd for rnd, _ in store.evaluations(summary["run_id"])}
        assert evaluated == {2, 4, 5}
        for rnd in range(1, 6):
            figures = federated(rounds[rnd].metrics)
            if rnd not in evaluated:
                assert figures == {} and "federated_eval_s" not in rounds[rnd].metrics
                continue
            records = list(answers(store, summary["run_id"], rnd).values())
            assert sorted(r.client_id for r in records) == ["1", "2", "3", "4"]
            assert all(r.fate == "accepted" and r.num_examples > 0 for r in records)
            assert figures == pytest.approx(spread(records))
            assert rounds[rnd].metrics["federated_eval_s"] > 0
            # the evaluation's model download counts in its round's traffic: twice a
            # training round's (every client trains and evaluates)
            assert rounds[rnd].metrics["bytes_down"] == 2 * rounds[1].metrics["bytes_down"]
        last = rounds[5].metrics
    for key in ("federated_accuracy", "federated_accuracy_p10", "federated_accuracy_min"):
        assert summary[key] == pytest.approx(last[key])
    assert "federated_accuracy_personal" not in summary


# ---- who is asked


def test_cohorts_from_the_seed_without_dp_and_secret_under_dp(monkeypatch):
    nodes = list(range(1, 21))
    drawn = {tuple(cohort_module.evaluation_cohort(nodes, fraction=0.3, seed=4, rnd=2, dp=None))
             for _ in range(20)}
    assert len(drawn) == 1 and len(next(iter(drawn))) == 6
    replay = SimpleNamespace(secret_cohorts=False)  # dp.reproducible_cohorts
    assert cohort_module.evaluation_cohort(nodes, fraction=0.3, seed=4, rnd=2, dp=replay) \
        == list(next(iter(drawn)))
    secret = SimpleNamespace(secret_cohorts=True)
    draws = {tuple(cohort_module.evaluation_cohort(nodes, fraction=0.3, seed=4, rnd=2,
                                                   dp=secret)) for _ in range(20)}
    assert len(draws) > 1 and all(len(d) == 6 for d in draws)
    assert cohort_module.evaluation_cohort(nodes, fraction=0.01, seed=4, rnd=2, dp=None) \
        .__len__() == 1  # at least one client


def test_seeded_runs_ask_the_same_clients_and_dp_runs_draw_in_secret(run_inprocess, store,
                                                                    monkeypatch):
    calls: list[tuple[int, bool]] = []
    rng = cohort_module.cohort_rng

    def spy(seed: int, rnd: int, *, secret: bool, stream: int = 0) -> np.random.Generator:
        calls.append((stream, secret))
        return rng(seed, rnd, secret=secret, stream=stream)

    monkeypatch.setattr(cohort_module, "cohort_rng", spy)
    cfg = config("federation.evaluate_fraction=0.4", "federation.rounds=2")
    asked = []
    for _ in range(2):
        summary = run_inprocess(cfg)
        asked.append([(r, e.client_id) for r, e in store.evaluations(summary["run_id"])])
    assert asked[0] == asked[1] and len(asked[0]) == 4  # 2 of 5 clients, 2 rounds
    assert (3, False) in calls and (3, True) not in calls
    calls.clear()
    dp = config("federation.evaluate_fraction=0.4", "dp.mode=central", "dp.clip=1.0",
                "aggregation.weight_by=uniform", "dp.noise_multiplier=0.8")
    summary = run_inprocess(dp)
    assert [s for s in calls if s[0] == 3] == [(3, True)]  # OS entropy, like the cohorts
    assert len(store.evaluations(summary["run_id"])) == 2


# ---- clients that fail or lie


class SilentGrid(InProcessGrid):
    """Node 2 never answers an evaluate message (killed); for node 3 the SuperLink answers
    that the node is gone, as Flower does for a node that stopped sending heartbeats."""

    def pull_messages(self, message_ids):
        for msg_id in message_ids:
            msg = self._queue.get(msg_id)
            if msg is None or msg.metadata.message_type != "evaluate":
                yield from super().pull_messages([msg_id])
            elif msg.metadata.dst_node_id == 3:
                del self._queue[msg_id]
                reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable"),
                                reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                yield reply
            elif msg.metadata.dst_node_id != 2:
                yield from super().pull_messages([msg_id])


def test_a_client_gone_during_evaluation_is_dropped_and_the_others_make_the_figures(
        run_inprocess, store):
    cfg = config("federation.round_timeout_s=1")
    summary = run_inprocess(cfg, grid=SilentGrid(client_app, 5))
    records = answers(store, summary["run_id"], 1)
    assert records["2"].fate == "dropped" and "no reply within 1 s" in records["2"].reason
    assert records["3"].fate == "dropped" and "node 3 unreachable" in records["3"].reason
    assert {c for c, r in records.items() if r.fate == "accepted"} == {"1", "4", "5"}
    metrics = store.rounds(summary["run_id"])[1].metrics
    assert metrics["federated_clients"] == 3
    assert federated(metrics) == pytest.approx(spread(records.values()))
    assert summary["versions"] == 1  # training went on


def hostile_evaluator() -> ClientApp:
    """Trains honestly; evaluates honestly on partitions 0, 5 and 6, badly on the others."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client_app(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        if pid in (0, 5, 6):
            return client_app(msg, context)
        if pid == 4:
            raise RuntimeError("evaluation crashed")
        metrics = {1: {"num-examples": 10, "eval_loss": float("nan"), "eval_acc": 0.5},
                   2: {"num-examples": 10, "eval_loss": 0.3, "eval_acc": 1.5},
                   3: {"eval_loss": 0.3, "eval_acc": 0.5}}[pid]
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


class LyingGrid(InProcessGrid):
    """Node 6's evaluate reply claims to come from node 7; node 7's arrives twice."""

    def _deliver(self, msg_id: str, msg: Message) -> Message:
        reply = super()._deliver(msg_id, msg)
        if msg.metadata.message_type == "evaluate" and msg.metadata.dst_node_id == 6:
            reply.metadata.__dict__["_src_node_id"] = 7
        return reply

    def pull_messages(self, message_ids):
        node = {i: self._queue[i].metadata.dst_node_id for i in message_ids if i in self._queue}
        for reply in super().pull_messages(message_ids):
            yield reply
            if reply.metadata.message_type == "evaluate" \
                    and node[reply.metadata.reply_to_message_id] == 7:
                yield reply  # replayed


def test_hostile_evaluate_replies_are_rejected_with_their_reasons(run_inprocess, store):
    cfg = config("federation.clients=7")
    summary = run_inprocess(cfg, grid=LyingGrid(hostile_evaluator(), 7))
    records = [e for _, e in store.evaluations(summary["run_id"], round=1)]
    reasons = {e.client_id: e.reason for e in records if e.fate == "rejected"}
    assert reasons["2"] == "evaluate reply's 'eval_loss' must be a finite number, got nan"
    assert reasons["3"] == "evaluate reply's 'eval_acc' must be in [0, 1], got 1.5"
    assert "'num-examples' must be an integer >= 1, got None" in reasons["4"]
    assert "client error" in reasons["5"] and "evaluation crashed" in reasons["5"]
    assert reasons["6"] == "reply to the message sent to node 6 says it comes from node 7"
    replays = [e for e in records if e.client_id == "7"]
    assert [e.fate for e in replays] == ["accepted", "rejected"]
    assert "awaits no reply (a duplicate or a replay)" in replays[1].reason
    assert sorted(e.client_id for e in records if e.fate == "accepted") == ["1", "7"]
    metrics = store.rounds(summary["run_id"])[1].metrics
    assert metrics["federated_clients"] == 2 and summary["versions"] == 1


def test_a_round_without_an_accepted_answer_records_no_figures(run_inprocess, store):
    app = ClientApp()
    app.train()(client_app)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        raise RuntimeError("no data")

    summary = run_inprocess(config(), app)
    metrics = store.rounds(summary["run_id"])[1].metrics
    assert federated(metrics) == {} and "federated_accuracy" not in summary
    assert {e.fate for _, e in store.evaluations(summary["run_id"])} == {"rejected"}


# ---- a stock Flower ClientApp answers fedring's server


def stock_flower_app(task: ScenarioTask, clients: int) -> ClientApp:
    """Written like Flower's quickstart: the model loads "arrays", evaluates on the node's
    own slice of data and replies eval_loss, eval_acc and num-examples. Node ``i``'s slice
    is every ``clients``-th example of the task's test set, so the slices cover it once."""
    app = ClientApp()
    x_all, y_all = torch.from_numpy(task.dataset.x_test), torch.from_numpy(task.dataset.y_test)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        state = msg.content["arrays"].to_torch_state_dict()
        content = RecordDict({"arrays": ArrayRecord(state),
                              "metrics": MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = task.build_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.eval()
        pid = context.node_config["partition-id"]
        x, y = x_all[pid::clients], y_all[pid::clients]
        with torch.no_grad():
            logits = model(x)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(1) == y).float().mean())
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(x)})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def test_a_stock_flower_client_apps_evaluations_are_accepted(run_inprocess, store):
    cfg = config()
    task = ScenarioTask.from_config(cfg)
    summary = run_inprocess(cfg, stock_flower_app(task, 5))
    records = answers(store, summary["run_id"], 1)
    assert [r.fate for r in records.values()] == ["accepted"] * 5
    assert sum(r.num_examples for r in records.values()) == len(task.dataset.y_test)
    metrics = store.rounds(summary["run_id"])[1].metrics
    # the slices cover the central test set once: the weighted figures are the central ones
    assert metrics["federated_accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-6)
    assert metrics["federated_loss"] == pytest.approx(metrics["loss"], rel=1e-5)


# ---- every kind of round with a global model evaluates


def test_fedbuff_evaluates_each_applied_aggregate(run_inprocess, store):
    cfg = config("driver.kind=fedbuff", "driver.buffer_size=2", "federation.rounds=2")
    summary = run_inprocess(cfg)
    assert summary["driver"] == "fedbuff" and summary["versions"] == 2
    rounds = {r.round: r.metrics for r in store.rounds(summary["run_id"])}
    model_bytes = ScenarioTask.from_config(cfg).initial_params()[0].nbytes
    for rnd in (1, 2):
        records = answers(store, summary["run_id"], rnd)
        assert len(records) == 5 and all(r.fate == "accepted" for r in records.values())
        assert federated(rounds[rnd]) == pytest.approx(spread(records.values()))
        assert rounds[rnd]["bytes_down"] >= 5 * model_bytes  # the evaluation's downloads
    assert summary["federated_accuracy"] == rounds[2]["federated_accuracy"]
    for rnd, metrics in rounds.items():  # e.g. the aborted round of the leftover replies
        if rnd not in (1, 2):
            assert not answers(store, summary["run_id"], rnd) and federated(metrics) == {}


def test_secure_sync_rounds_evaluate(run_inprocess, store):
    summary = run_inprocess(config("secagg.enabled=true"))
    assert summary["versions"] == 1 and store.secagg_rounds(summary["run_id"])
    records = answers(store, summary["run_id"], 1)
    assert len(records) == 5 and all(r.fate == "accepted" for r in records.values())
    assert summary["federated_accuracy"] == pytest.approx(spread(records.values())
                                                          ["federated_accuracy"])


# ---- the target may mean the federated figure


def test_target_on_federated_stops_when_the_federated_accuracy_reaches_it(run_inprocess,
                                                                         store):
    # round 1 evaluates on the server only (evaluate_every = 2), so however good its central
    # accuracy, the run cannot stop before round 2, whose federated figure is over 0.3
    cfg = config("federation.rounds=5", "federation.evaluate_every=2",
                 "driver.target_accuracy=0.3", "driver.target_on=federated")
    summary = run_inprocess(cfg)
    rounds = {r.round: r.metrics for r in store.rounds(summary["run_id"])}
    assert rounds[1]["accuracy"] >= 0.3 and "federated_accuracy" not in rounds[1]
    assert summary["rounds"] == 2 and summary["reached_target"] is True
    assert rounds[2]["federated_accuracy"] >= 0.3
    assert summary["federated_accuracy"] == rounds[2]["federated_accuracy"]


# ---- a resumed run records its evaluations again


def test_resume_records_the_replayed_rounds_evaluations_again(db_url, store):
    cfg = config("federation.rounds=3", "federation.checkpoint_every=2")

    def run(resume: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = {}
        app = make_server_app(build_task, config_from_run_config, config=cfg,
                              store_url=db_url, on_summary=result.update, resume=resume)
        app(InProcessGrid(client_app, 5), Context(run_id=1, node_id=0, node_config={},
                                                  state=RecordDict(), run_config={}))
        return result

    run_id = run()["run_id"]
    first = store.evaluations(run_id, round=3)
    # as if the server died after recording round 3 and before its checkpoint
    store.record_round(run_id, round=3, model_version=3,
                       evaluations=[EvalRecord("999", "accepted", num_examples=1, loss=0.0,
                                               accuracy=1.0)])
    with store._session() as s, s.begin():  # the checkpoint never written
        from sqlalchemy import delete

        from server.store.models import CheckpointRow
        s.execute(delete(CheckpointRow).where(CheckpointRow.run_id == run_id,
                                              CheckpointRow.round == 3))
    resumed = run(run_id)
    assert resumed["resumed_after_round"] == 2 and resumed["rounds"] == 3
    again = store.evaluations(run_id, round=3)
    assert [e.client_id for _, e in again] == [e.client_id for _, e in first]
    assert all(e.client_id != "999" for _, e in store.evaluations(run_id))
    assert [r for r, _ in store.evaluations(run_id)] == [1] * 5 + [2] * 5 + [3] * 5
    assert federated(store.rounds(run_id)[3].metrics) == pytest.approx(
        spread(e for _, e in again))


# ---- configurations that cannot evaluate fail at start


@pytest.mark.parametrize("overrides, message", [
    (["data.client_test_fraction=0"], "data.client_test_fraction = 0 holds none out: set "
                                      "data.client_test_fraction"),
    (["federation.evaluate_fraction=0", "driver.target_on=federated"],
     "driver.target_on = 'federated' compares the target with the clients' federated "
     "evaluation, which federation.evaluate_fraction = 0 turns off"),
    (["driver.target_on=personal"], "driver.target_on = 'personal' means each client's own "
                                    "model, but without aggregation.local_buffers = true"),
    (["federation.secure_evaluation=true"], "needs secure aggregation: set secagg.enabled = "
                                            "true"),
    (["federation.evaluate_fraction=0", "federation.secure_evaluation=true",
      "secagg.enabled=true"], "federation.secure_evaluation = true needs a federated "
                              "evaluation: set federation.evaluate_fraction > 0"),
    (["secagg.enabled=true", "federation.secure_evaluation=true",
      "federation.evaluate_fraction=0.2"], "asks 1 of 5 clients, fewer than "
                                           "secagg.min_survivors = 3"),
    (["secagg.enabled=true", "federation.secure_evaluation=true", "driver.kind=cross_silo"],
     "which driver.kind = 'cross_silo' silos do not answer"),
    (["driver.kind=gossip", "driver.target_accuracy=0.5"],
     "set driver.target_on = 'federated', got 'central'"),
    (["gossip.holdout_fraction=0.3"], "gossip.holdout_fraction moved to "
                                      "data.client_test_fraction"),
])
def test_configurations_that_cannot_evaluate_fail_at_start(overrides, message):
    with pytest.raises(ValueError) as raised:
        config(*overrides)
    assert message in str(raised.value)


def test_gossip_may_stop_at_a_target_on_its_silos_own_accuracy():
    cfg = config("driver.kind=gossip", "driver.target_accuracy=0.5", "driver.target_on=federated")
    assert cfg["driver"]["target_on"] == "federated"


def test_the_server_refuses_them_too_in_a_configuration_made_by_hand(run_inprocess):
    cfg = config()
    cfg["data"]["client_test_fraction"] = 0.0
    with pytest.raises(ValueError, match=r"data\.client_test_fraction"):
        run_inprocess(cfg)
