"""The in-process engine at population scale: nodes made when first sampled, node state
kept in a bounded cache that spills to disk and comes back exactly, cohorts drawn over a
``range`` equal to those drawn over a list."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from client.protocol.train import train_config
from client.protocol.updates import model_record
from server.cohort import draw_fixed, evaluation_cohort, sample_nodes
from server.config import FederationConfig
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.engine_config import EngineConfig
from simulations.inprocess import InProcessGrid
from simulations.node_states import NodeContexts, SpillStore
from simulations.task import ScenarioTask, task_spec


def _context(node: int) -> Context:
    return Context(run_id=1, node_id=node, node_config={"partition-id": node - 1},
                   state=RecordDict(), run_config={})


def _state(seed: int) -> RecordDict:
    rng = np.random.default_rng(seed)
    return RecordDict({
        "m": ArrayRecord({"v": Array(rng.standard_normal(7).astype(np.float32)),
                          "c": Array(np.arange(3, dtype=np.int64))}),
        "c": ConfigRecord({"steps": seed, "eps": 0.1 * seed, "tag": b"\x00\x01", "l": [1, 2]}),
        "q": MetricRecord({"spent": 1.5 * seed})})


def _same(a: RecordDict, b: RecordDict) -> None:
    assert list(a) == list(b)
    for key, record in a.items():
        other = b[key]
        assert type(record) is type(other)
        if isinstance(record, ArrayRecord):
            for name, array in record.items():
                np.testing.assert_array_equal(array.numpy(), other[name].numpy())
                assert array.numpy().dtype == other[name].numpy().dtype
        else:
            assert dict(record) == dict(other)


def test_a_node_evicted_to_disk_gets_back_the_state_it_left():
    nodes = NodeContexts(1000, _context, capacity=2)
    for node in (5, 9):
        nodes[node].state = _state(node)
    nodes[17]  # a third node evicts node 5, the least recently used
    assert nodes.in_memory == 2 and nodes.spill is not None and len(nodes.spill) == 1
    nodes[40]  # and node 9
    assert len(nodes.spill) == 2
    for node in (5, 9):
        context = nodes[node]
        _same(context.state, _state(node))
        assert context.node_config == {"partition-id": node - 1}
    assert nodes.spill.restored == 2
    nodes.close()


def test_a_stateless_node_costs_nothing_on_disk_and_pinned_nodes_stay():
    nodes = NodeContexts(10**7, _context, capacity=1)
    assert len(nodes) == 10**7 and nodes.in_memory == 0 and 10**7 in nodes and 0 not in nodes
    for node in range(1, 50):
        nodes[node]
    assert nodes.in_memory == 1 and nodes.spill is None
    with nodes.pinned([3, 4, 5]):
        held = [nodes[n] for n in (3, 4, 5)]
        nodes[6]
        assert all(nodes[n] is c for n, c in zip((3, 4, 5), held, strict=True))
    assert nodes.in_memory == 1
    with pytest.raises(KeyError):
        nodes[10**7 + 1]


def test_the_grid_makes_nodes_when_first_sampled():
    grid = InProcessGrid(client_app, 15_000_000, node_cache=100)
    ids = grid.get_node_ids()
    assert isinstance(ids, range) and len(ids) == 15_000_000 and ids[0] == 1
    spec = task_spec(load_scenario("default", ["federation.clients=15000000",
                                               "train.local_epochs=1"]))
    params, layout = ScenarioTask(spec).initial_params()
    config = train_config(1, 0, json.dumps(spec, sort_keys=True), 0)
    cohort = [7, 14_999_999]
    replies = grid.send_and_receive([grid.create_message(
        RecordDict({"arrays": model_record(layout, params), "config": config}), "train", n, "1")
        for n in cohort])
    assert sorted(m.metadata.src_node_id for m in replies) == cohort
    assert grid._contexts.in_memory == 2


def _stateful(clients: int = 6, rounds: int = 3) -> dict[str, Any]:
    """Client momentum and FedBN: each client keeps state from round to round."""
    return load_scenario("default", [f"federation.clients={clients}",
                                     f"federation.rounds={rounds}", "federation.min_clients=1",
                                     "federation.sample_fraction=0.5", "train.local_epochs=1",
                                     "model.kind=bn_mlp", "model.hidden=[16]",
                                     "aggregation.local_buffers=true",
                                     "aggregation.client_momentum=0.75"])


def test_stateful_clients_across_evictions_reach_the_unbounded_model(run_inprocess):
    config = _stateful()
    unbounded: list[np.ndarray] = []
    run_inprocess(config, models=unbounded)
    bounded: list[np.ndarray] = []
    grid = InProcessGrid(client_app, 6, node_cache=1)
    run_inprocess(config, grid=grid, models=bounded)
    spill = grid._contexts.spill
    assert spill is not None and spill.spilled > 0 and spill.restored > 0  # it did spill
    assert len(bounded) == len(unbounded) == 4
    for a, b in zip(bounded, unbounded, strict=True):
        np.testing.assert_array_equal(a, b)
    grid.close()


def test_losing_the_state_would_change_the_model(run_inprocess, monkeypatch):
    """The check above can fail: nodes that forget their state reach another model."""
    config = _stateful()
    kept: list[np.ndarray] = []
    run_inprocess(config, models=kept)
    forgetful: list[np.ndarray] = []
    monkeypatch.setattr(SpillStore, "put", lambda *_: None)  # evicted states are dropped
    grid = InProcessGrid(client_app, 6, node_cache=1)
    run_inprocess(config, grid=grid, models=forgetful)
    assert not np.array_equal(kept[-1], forgetful[-1])


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_cohorts_over_a_range_are_those_over_a_list(seed):
    nodes = range(1, 200_001)  # more than one chunk of Poisson draws
    listed = list(nodes)[::-1]  # any order: drawn as sorted
    fixed = FederationConfig(sample_fraction=0.01)
    poisson = FederationConfig(sampling="poisson", sample_fraction=0.003)
    for fed in (fixed, poisson):
        a = sample_nodes(nodes, fed, np.random.default_rng([seed, 2]))
        b = sample_nodes(listed, fed, np.random.default_rng([seed, 2]))
        assert a == b and len(a) > 0
    picks = np.random.default_rng([seed, 2]).random(len(nodes)) < 0.003  # one draw of N
    assert sample_nodes(nodes, poisson, np.random.default_rng([seed, 2])) == \
        [n for n, pick in zip(nodes, picks, strict=True) if pick]
    assert draw_fixed(nodes, 5, np.random.default_rng(seed)) == \
        draw_fixed(listed, 5, np.random.default_rng(seed))
    assert evaluation_cohort(nodes, fraction=0.001, seed=seed, rnd=3, dp=None) == \
        evaluation_cohort(listed, fraction=0.001, seed=seed, rnd=3, dp=None)


def test_engine_keys_are_checked():
    assert EngineConfig().node_cache_bound == 10_000
    assert EngineConfig(node_cache=0).node_cache_bound is None
    assert EngineConfig(threads="auto").threads == "auto"
    for bad in ({"node_cache": -1}, {"node_cache": 1.5}, {"threads": -2}, {"threads": "many"}):
        with pytest.raises(ValueError, match=f"engine.{next(iter(bad))} must be"):
            EngineConfig(**bad)


def test_profiles_of_a_range_are_those_of_its_list():
    from server.driver_config import ClientsConfig
    from simulations.heterogeneity import ClientProfiles

    cfg = ClientsConfig(speed_sigma=0.5, straggler_fraction=0.2, offline_fraction=0.3)
    ranged, listed = ClientProfiles(cfg, 3), ClientProfiles(cfg, 3)
    ranged.bind(range(1, 501))
    listed.bind(list(range(500, 0, -1)))
    for node in (1, 2, 250, 500):
        assert ranged.duration(node, 0.0) == listed.duration(node, 0.0)
        assert ranged.online(node, 7.5) == listed.online(node, 7.5)
    assert ranged.describe() == listed.describe() and not ranged.always_online()
    with pytest.raises(LookupError):
        ranged.duration(501, 0.0)
    steady = ClientProfiles(ClientsConfig(), 3)
    steady.bind(range(1, 10**7))
    assert steady.always_online()
