"""In-process replies share the client's delta buffer; a reply kept for later (a late
update carried into the next round) is never overwritten by the client's next delta."""

from __future__ import annotations

import math

import numpy as np
import pytest

from client.protocol.keys import ConfigKey
from client.protocol.npy import npy_view
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.task import ScenarioTask


def _recording(sent: dict[tuple[str, int], np.ndarray], addresses: list[int]):
    """fedring's ClientApp, keeping a copy of each delta as sent, by (client, version)."""

    def app(msg, context):
        reply = client_app(msg, context)
        arr = reply.content["delta"]["delta"]
        assert isinstance(arr.data, bytearray)  # shared, not serialised
        view = npy_view(arr)
        addresses.append(view.ctypes.data)
        version = msg.content["config"][ConfigKey.VERSION]
        sent[(str(context.node_id), version)] = view.copy()
        return reply

    return app


@pytest.mark.parametrize("combine", ["median", "mean"])
def test_aggregate_is_that_of_the_replies_as_sent(small_config, run_inprocess, combine):
    config = {**small_config, "federation": {**small_config["federation"], "rounds": 1},
              "aggregation": {**small_config["aggregation"], "combine": combine}}
    sent: dict[tuple[str, int], np.ndarray] = {}
    addresses: list[int] = []
    models: list[np.ndarray] = []
    run_inprocess(config, _recording(sent, addresses), models=models)
    deltas = np.stack([sent[(str(node), 0)] for node in range(1, 6)])
    if combine == "median":
        np.testing.assert_array_equal(models[1], models[0] + np.median(deltas, axis=0))
    else:
        task = ScenarioTask.from_config(config)
        weights = [len(task.partition(pid)[1]) for pid in range(5)]
        expected = models[0] + np.average(deltas, axis=0, weights=weights)
        np.testing.assert_allclose(models[1], expected, rtol=0, atol=1e-6)
        assert len(set(addresses)) < 5  # buffers were reused within the round


def test_late_replies_carried_into_later_rounds_stay_intact(run_inprocess, store):
    config = load_scenario("default", [
        "federation.clients=5", "federation.rounds=6", "train.local_epochs=1",
        "clients.straggler_fraction=0.2", "clients.straggler_slowdown=5",
        "clients.compute_s=1.0", "driver.deadline_s=3", "driver.late_policy=carry"])
    sent: dict[tuple[str, int], np.ndarray] = {}
    summary = run_inprocess(config, _recording(sent, []), simulated=True)
    checked = carried = 0
    for _, u in store.updates(summary["run_id"]):
        if u.fate != "accepted":
            continue
        delta = sent[(u.client_id, u.base_version)]
        assert u.norm == pytest.approx(math.sqrt(float(np.dot(delta, delta))), rel=1e-6)
        checked += 1
        carried += u.staleness > 0
    assert carried >= 2 and checked > carried  # some replies waited while others came in
