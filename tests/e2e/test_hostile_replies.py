"""Bad replies are rejected with a stored reason and the round goes on with the rest."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_array
from simulations.apps import client_app as honest_app


def _delta_reply(msg: Message, delta, metrics: dict) -> Message:
    record = ArrayRecord()
    record["delta"] = npy_array(np.asarray(delta))
    return Message(RecordDict({"delta": record, "metrics": MetricRecord(metrics)}), reply_to=msg)


def hostile_app(dim: int) -> ClientApp:
    """Partition 0 is honest; the others each send one kind of bad reply."""
    app = ClientApp()
    ok = {"num-examples": 5, MetricKey.BASE_VERSION: 0}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        if pid == 0:
            return honest_app(msg, context)
        if pid == 1:
            return _delta_reply(msg, np.full(dim, np.nan, np.float32), ok)
        if pid == 2:
            return _delta_reply(msg, np.zeros(dim + 3, np.float32), ok)
        if pid == 3:
            return _delta_reply(msg, np.zeros(dim, np.float64), ok)
        if pid == 4:
            return _delta_reply(msg, np.zeros(dim, np.float32), {"num-examples": 0,
                                                                  MetricKey.BASE_VERSION: 0})
        if pid == 5:
            return _delta_reply(msg, np.zeros(dim, np.float32), {MetricKey.BASE_VERSION: 0})
        if pid == 6:
            bad = ArrayRecord()
            bad["delta"] = npy_array(np.zeros(dim, np.float32))
            bad["delta"].data = bad["delta"].data[:-7]  # truncated bytes
            return Message(RecordDict({"delta": bad, "metrics": MetricRecord(ok)}),
                           reply_to=msg)
        raise RuntimeError("client crashed")

    return app


def test_each_bad_reply_rejected_with_reason(small_config, run_inprocess, store):
    from simulations.task import ScenarioTask

    dim = ScenarioTask.from_config(small_config).initial_params()[1].dim
    cfg = {**small_config, "federation": {**small_config["federation"], "clients": 8,
                                          "rounds": 1}}
    summary = run_inprocess(cfg, hostile_app(dim))
    assert summary["versions"] == 1  # the honest update was applied
    rnd = store.rounds(summary["run_id"])[-1]
    assert (rnd.num_accepted, rnd.num_rejected, rnd.status) == (1, 7, "completed")
    reasons = sorted(u.reason for _, u in store.updates(summary["run_id"], round=1)
                     if u.fate == "rejected")
    expected = ["NaN/Inf", "shape", "dtype is float64", "positive integer, got 0",
                "lack 'num-examples'", "payload has", "client error"]
    for fragment in expected:
        assert any(fragment in r for r in reasons), (fragment, reasons)


def test_a_round_with_every_reply_rejected_keeps_the_version_and_the_run_goes_on(
        small_config, run_inprocess, store):
    """Round 2: every client sends NaN. Nothing is applied, the version stays, the round is
    recorded as failed with every rejection, and round 3 trains on as usual."""
    from simulations.task import ScenarioTask

    dim = ScenarioTask.from_config(small_config).initial_params()[1].dim
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["server-round"]) == 2:
            version = int(msg.content["config"][ConfigKey.VERSION])
            return _delta_reply(msg, np.full(dim, np.nan, np.float32),
                                {"num-examples": 5, MetricKey.BASE_VERSION: version})
        return honest_app(msg, context)

    cfg = {**small_config, "federation": {**small_config["federation"], "clients": 3,
                                          "rounds": 3}}
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, app, models=models)
    assert (summary["status"], summary["rounds"], summary["versions"]) == ("completed", 3, 2)
    rounds = store.rounds(summary["run_id"])
    assert [(r.round, r.model_version, r.status) for r in rounds] == [
        (0, 0, "completed"), (1, 1, "completed"), (2, 1, "failed"), (3, 2, "completed")]
    second = rounds[2]
    assert (second.num_sampled, second.num_replies, second.num_accepted,
            second.num_rejected) == (3, 3, 0, 3)
    updates = [u for _, u in store.updates(summary["run_id"], round=2)]
    assert len(updates) == 3 and all(u.fate == "rejected" and "NaN/Inf" in u.reason
                                     for u in updates)
    assert len(models) == 4
    np.testing.assert_array_equal(models[2], models[1])  # the model is unchanged
    assert np.abs(models[3] - models[2]).max() > 1e-4  # and training goes on after it
