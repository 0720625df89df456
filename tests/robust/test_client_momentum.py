"""Worker momentum (``aggregation.client_momentum``): each node sends
``m <- beta m + (1 - beta) delta`` (its first delta as is), kept in its own
``Context.state`` from round to round and fresh in a new run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from client.momentum import momentum_update
from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey
from client.protocol.train import read_client_momentum, train_config
from client.protocol.updates import model_record, read_delta
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask, task_spec

BETA = 0.75


def test_momentum_by_hand_over_two_rounds():
    state = RecordDict()
    d1 = np.array([1.0, -2.0, 4.0], dtype=np.float32)
    d2 = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(momentum_update(state, d1.copy(), BETA), d1)
    # 0.75 * [1, -2, 4] + 0.25 * [3, 2, 0] = [1.5, -1, 3]
    np.testing.assert_allclose(momentum_update(state, d2.copy(), BETA), [1.5, -1.0, 3.0])
    # 0.75 * [1.5, -1, 3] + 0.25 * [3, 2, 0] = [1.875, -0.25, 2.25]
    np.testing.assert_allclose(momentum_update(state, d2.copy(), BETA), [1.875, -0.25, 2.25])


def train_rounds(spec: dict, grid: InProcessGrid, rounds: range, beta: float,
                 nodes: list[int]) -> list[dict[int, np.ndarray]]:
    """What each of ``nodes`` sends in each of ``rounds`` (same model each time)."""
    params, layout = ScenarioTask(spec).initial_params()
    sent = []
    for r in rounds:
        config = train_config(r, r - 1, json.dumps(spec, sort_keys=True), 0,
                              client_momentum=beta)
        msgs = [grid.create_message(RecordDict({"arrays": model_record(layout, params),
                                                "config": config}), "train", n, str(r))
                for n in nodes]
        replies = grid.send_and_receive(msgs)
        assert not any(m.has_error() for m in replies)
        sent.append({m.metadata.src_node_id: read_delta(m.content["delta"]).copy()
                     for m in replies})
    return sent


def test_each_node_keeps_its_own_momentum_and_a_new_run_starts_fresh():
    spec = task_spec(load_scenario("default", ["federation.clients=3", "train.local_epochs=1"]))
    grid = InProcessGrid(client_app, 3)
    a, b, c = grid.get_node_ids()
    raw = train_rounds(spec, InProcessGrid(client_app, 3), range(1, 3), 0.0, [a, b, c])
    # c sits out round 1: its first momentum is its round-2 delta
    first = train_rounds(spec, grid, range(1, 2), BETA, [a, b])
    [second] = train_rounds(spec, grid, range(2, 3), BETA, [a, b, c])
    for n in (a, b):
        np.testing.assert_array_equal(first[0][n], raw[0][n])
        np.testing.assert_allclose(second[n], BETA * raw[0][n] + (1 - BETA) * raw[1][n],
                                   rtol=1e-5, atol=1e-7)
        assert not np.allclose(second[n], raw[1][n], atol=1e-4)
    np.testing.assert_array_equal(second[c], raw[1][c])
    [fresh] = train_rounds(spec, InProcessGrid(client_app, 3), range(1, 2), BETA, [a])  # a new run
    np.testing.assert_array_equal(fresh[a], raw[0][a])


def test_a_run_with_client_momentum_and_secure_aggregation_completes(run_inprocess):
    cfg = load_scenario("default", ["federation.clients=5", "train.local_epochs=1",
                                    "federation.rounds=2", "secagg.enabled=true",
                                    "aggregation.combine=centered_clip",
                                    "aggregation.clip_radius=0.5",
                                    f"aggregation.client_momentum={BETA}"])
    assert run_inprocess(cfg)["status"] == "completed"


@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, True, "0.9"])
def test_a_bad_client_momentum_fails_at_start(value):
    with pytest.raises(ValueError, match=r"aggregation\.client_momentum must be"):
        load_scenario("default", values={"aggregation.client_momentum": value})


@pytest.mark.parametrize("value", [1.0, -0.5, True, "0.9"])
def test_a_malformed_momentum_on_the_wire_is_refused(value):
    with pytest.raises(WireError, match=ConfigKey.CLIENT_MOMENTUM):
        read_client_momentum(ConfigRecord({ConfigKey.CLIENT_MOMENTUM: value}))
    assert read_client_momentum(ConfigRecord({})) == 0.0


def test_cross_silo_refuses_client_momentum():
    with pytest.raises(ValueError, match=r"set aggregation\.client_momentum = 0"):
        load_scenario("default", ["driver.kind=cross_silo", "federation.clients=3",
                                  "aggregation.client_momentum=0.9"])
    load_scenario("default", ["driver.kind=cross_silo", "federation.clients=3"])
