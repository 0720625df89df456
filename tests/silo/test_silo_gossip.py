"""Gossip rounds (D-PSGD) among silos: real gloo groups in real processes.

The mixing and the consensus distance are checked against W @ X and the spread computed
here; on the in-process engine, against silos trained here from the initial model. A
silo that dies is dropped from the next round's topology; a failed round leaves every
silo's model as it was.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from flwr.app import Context, Error, Message
from silo_helpers import join_then_die, scenario, survivors_of_a_dead_peer, trained_silo

from aggregation.gossip import metropolis_hastings, topology
from aggregation.ring import RingError
from client.flat_model import FlatModel
from client.protocol.npy import npy_view
from client.protocol.ring import RingRecord, RingSpec
from client.silo.gossip import GOSSIP_STATE, mix
from client.training import evaluate
from server.gossip import GossipCollector
from simulations.apps import spec_from_run_config
from simulations.config import load_scenario
from simulations.partitioners import client_test_split
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask

pytestmark = pytest.mark.slow


def mh_weights(adjacency: list[frozenset[int]]) -> np.ndarray:
    """Metropolis–Hastings weights, written out here: 1 / (1 + max degree) on an edge."""
    n = len(adjacency)
    w = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if j in adjacency[i]:
                w[i, j] = 1.0 / (1 + max(len(adjacency[i]), len(adjacency[j])))
    return w + np.diag(1.0 - w.sum(axis=1))


def spread(models: np.ndarray) -> float:
    """(1/n) sum_i ||x_i - mean||^2, directly."""
    x = models.astype(np.float64)
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))


def run_group(models: np.ndarray, adjacency: list[frozenset[int]],
              weights: np.ndarray) -> list[Any]:
    """Every rank mixes its row of ``models`` in one gloo group, each from its own thread
    (and ring process); the MixResults by rank."""
    n = len(models)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    results: dict[int, Any] = {}

    def silo(rank: int) -> None:
        spec = RingSpec(host="127.0.0.1", port=store.port, prefix=f"mix-{n}", rank=rank,
                        size=n, join_timeout_s=30, ring_timeout_s=10)
        nbrs = tuple(sorted(adjacency[rank]))
        try:
            results[rank] = mix(models[rank], nbrs, tuple(weights[rank, j] for j in nbrs),
                                weights[rank, rank], spec)
        except BaseException as exc:  # reported by the assertion below
            results[rank] = exc

    threads = [threading.Thread(target=silo, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(not isinstance(results.get(r), BaseException) for r in range(n)), results
    return [results[r] for r in range(n)]


# 0 - 1 - 2 - {3, 4}, 3 - 4: rank 1's neighbours have different weights (1/3 and 1/4),
# which random graphs (nearly regular) seldom give.
IRREGULAR = [frozenset({1}), frozenset({0, 2}), frozenset({1, 3, 4}), frozenset({2, 4}),
             frozenset({2, 3})]


@pytest.mark.parametrize(("kind", "n", "degree"), [("ring", 3, 2), ("ring", 4, 2),
                                                   ("random", 5, 3), ("random", 5, 2),
                                                   ("irregular", 5, 0)])
def test_mixing_is_w_times_x_and_the_distance_is_the_spread(kind: str, n: int,
                                                            degree: int) -> None:
    adjacency = IRREGULAR if kind == "irregular" else topology(kind, n, degree=degree,
                                                                seed=[1, 2])
    w = mh_weights(adjacency)
    if degree != 2:
        assert len({len(a) for a in adjacency}) > 1  # irregular degrees
    if kind == "irregular":
        assert w[1, 0] != w[1, 2]
    x = np.random.default_rng(n).standard_normal((n, 1000)).astype(np.float32)
    results = run_group(x, adjacency, w)
    expected = w @ x.astype(np.float64)
    for rank, r in enumerate(results):
        np.testing.assert_allclose(r.mixed, expected[rank], rtol=0, atol=1e-5)
        assert r.distance == pytest.approx(spread(expected), rel=1e-6)
        assert r.bytes_sent == 4 * 1000 * len(adjacency[rank])
    assert len({r.digest for r in results}) == 1  # the same sum on every silo
    assert spread(expected) < spread(x)  # mixing contracts the models


def test_a_silo_dying_in_the_exchange_fails_its_neighbours_naming_it() -> None:
    errors, _, _ = survivors_of_a_dead_peer(lambda spec: mix(
        np.ones(1000, np.float32), (1 - spec.rank, 2), (1 / 3, 1 / 3), 1 / 3, spec))
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, RingError) for e in errors.values()), errors


# ---- rounds on the in-process engine

SILOS = 5


def gossip_scenario(rounds: int, **values: Any) -> dict[str, Any]:
    return scenario(rounds, **{"driver.kind": "gossip", "federation.clients": SILOS,
                               "gossip.topology": "random", "gossip.degree": 3, **values})


class Recorder:
    """The silo app, noting each message's (round, rank, node) and each silo's model after
    each round; ``fail`` may replace a silo's reply or its whole handling."""

    def __init__(self, fail: Callable[[int, int, Message, Context], Message | None]
                 | None = None) -> None:
        self.app = silo_client_app(ScenarioTask, spec_from_run_config)
        self.fail = fail
        self.ranks: dict[tuple[int, int], int] = {}  # (round, rank) -> node
        self.neighbours: dict[tuple[int, int], list[int]] = {}
        self.pending: dict[tuple[int, int], np.ndarray] = {}  # (round, node) -> mixed model
        self.states: dict[int, Any] = {}
        self.lock = threading.Lock()

    def __call__(self, msg: Message, context: Context) -> Message:
        ring = msg.content[RingRecord.SPEC]
        rnd, rank = int(msg.content["config"]["server-round"]), int(ring["rank"])
        with self.lock:
            self.ranks[(rnd, rank)] = context.node_id
            self.neighbours[(rnd, rank)] = list(ring["gossip.neighbours"])
            self.states[context.node_id] = context.state
        forced = self.fail(rnd, rank, msg, context) if self.fail else None
        if forced is not None:
            return forced
        reply = self.app(msg, context)
        record = context.state.get(GOSSIP_STATE)
        if record is not None and "pending" in record:
            self.pending[(rnd, context.node_id)] = np.array(npy_view(record["pending"]))
        return reply


# learners = 2: each silo trains two SMA learners and mixes its average model
@pytest.mark.parametrize("irregular, learners", [(False, 1), (True, 1), (False, 2)])
def test_a_gossip_round_mixes_the_silos_trained_models_and_stores_their_figures(
        run_inprocess, store, monkeypatch, irregular: bool, learners: int) -> None:
    if irregular:  # the server hands out IRREGULAR: a silo's weights differ by neighbour
        monkeypatch.setattr(GossipCollector, "mixing", lambda self, seed, rnd, n: (
            [sorted(a) for a in IRREGULAR], metropolis_hastings(IRREGULAR)))
    config = gossip_scenario(rounds=1, **{"silo.learners": learners})
    rec = Recorder()
    grid = ConcurrentGrid(rec, SILOS)
    summary = run_inprocess(config, grid=grid)
    assert summary["status"] == "completed" and summary["driver"] == "gossip"
    task = ScenarioTask.from_config(config)
    initial, _ = task.initial_params()
    node_pid = {node: grid._contexts[node].node_config["partition-id"]
                for node in grid._contexts}
    order = [rec.ranks[(1, r)] for r in range(SILOS)]
    x = np.stack([trained_silo(config, initial, node_pid[node], 1) for node in order])
    adjacency = [frozenset(rec.neighbours[(1, r)]) for r in range(SILOS)]
    assert all(r in adjacency[j] for r in range(SILOS) for j in adjacency[r])  # undirected
    assert (adjacency == IRREGULAR) == irregular
    expected = mh_weights(adjacency) @ x.astype(np.float64)
    for rank, node in enumerate(order):
        np.testing.assert_allclose(rec.pending[(1, node)], expected[rank], atol=2e-5)

    run_id = summary["run_id"]
    [_, rnd] = store.rounds(run_id)
    assert rnd.status == "completed" and rnd.num_accepted == SILOS
    assert rnd.metrics["consensus_distance"] == pytest.approx(spread(expected), rel=1e-4)
    updates = {int(u.client_id): u for _, u in store.updates(run_id, round=1)}
    evaluations = {int(e.client_id): e for _, e in store.evaluations(run_id, round=1)}
    accuracies, counts = [], []
    for rank, node in enumerate(order):
        pid = node_pid[node]
        idx = task.partitions()[pid]  # the held-out split, built here
        _, held = client_test_split(len(idx), 0.2, task.seed, pid)
        xs = torch.from_numpy(task.dataset.x_train[idx[held]])
        ys = torch.from_numpy(task.dataset.y_train[idx[held]])
        model = FlatModel(task.build_model())
        model.load(expected[rank].astype(np.float32))
        loss, acc = evaluate(model.module, xs, ys)
        m = updates[node].metrics
        assert m["heldout_acc"] == pytest.approx(acc, abs=1e-9)
        assert m["heldout_loss"] == pytest.approx(loss, rel=1e-4)
        assert m["heldout_examples"] == len(held)
        assert m["gossip_bytes"] == 4 * initial.size * len(adjacency[rank])
        e = evaluations[node]  # the silo's own model, as a federated evaluation record
        assert (e.fate, e.num_examples) == ("accepted", len(held))
        assert e.accuracy == pytest.approx(acc, abs=1e-9)
        assert e.loss == pytest.approx(loss, rel=1e-4)
        accuracies.append(acc)
        counts.append(len(held))
    assert rnd.metrics["accuracy"] == pytest.approx(np.mean(accuracies))
    assert rnd.metrics["federated_accuracy"] == pytest.approx(
        np.average(accuracies, weights=counts))
    assert rnd.metrics["federated_accuracy_min"] == pytest.approx(min(accuracies))
    assert rnd.metrics["gossip_bytes"] == sum(u.metrics["gossip_bytes"]
                                              for u in updates.values())


def test_silos_without_a_held_out_split_are_recorded_without_figures(run_inprocess,
                                                                     store) -> None:
    summary = run_inprocess(gossip_scenario(rounds=1, **{"data.client_test_fraction": 0.0}),
                            grid=ConcurrentGrid(Recorder(), SILOS))
    assert summary["status"] == "completed"
    evaluations = [e for _, e in store.evaluations(summary["run_id"], round=1)]
    assert len(evaluations) == SILOS
    assert all(e.fate == "rejected" and "data.client_test_fraction > 0" in e.reason
               for e in evaluations)
    [_, rnd] = store.rounds(summary["run_id"])
    assert rnd.num_accepted == SILOS and "heldout_acc" not in rnd.metrics


TIMEOUTS = {"silo.join_timeout_s": 15.0, "silo.ring_timeout_s": 3.0}


def test_a_silo_that_dies_is_dropped_from_the_next_topology(run_inprocess, store) -> None:
    """In round 2 one silo's ring process joins the group and dies: its peers fail and
    name it, it is excluded, and round 3 runs on a topology of the others."""
    victim: list[int] = []

    def die(rnd: int, rank: int, msg: Message, context: Context) -> Message | None:
        if rnd != 2 or rank != 1:
            return None
        victim.append(context.node_id)
        ring = msg.content[RingRecord.SPEC]
        spec = {k: ring[k] for k in ("host", "port", "prefix", "rank", "size")}
        proc = multiprocessing.get_context("forkserver").Process(target=join_then_die,
                                                                  args=(spec,))
        proc.start()
        proc.join(60)
        return Message(Error(0, "the silo died"), reply_to=msg)

    rec = Recorder(die)
    summary = run_inprocess(gossip_scenario(rounds=3, **TIMEOUTS),
                            grid=ConcurrentGrid(rec, SILOS))
    assert summary["status"] == "completed"
    run_id = summary["run_id"]
    _, first, second, third = store.rounds(run_id)
    assert (first.status, second.status, third.status) == ("completed", "failed", "completed")
    [dead] = victim
    updates = {u.client_id: u for _, u in store.updates(run_id, round=2)}
    assert updates[str(dead)].fate == "rejected"
    evaluations = {e.client_id: e for _, e in store.evaluations(run_id, round=2)}
    assert evaluations[str(dead)].fate == "rejected"  # with the update's reason
    assert evaluations[str(dead)].reason == updates[str(dead)].reason
    assert len(evaluations) == SILOS
    assert third.metrics["gossip_silos"] == SILOS - 1 and third.num_accepted == SILOS - 1
    assert dead not in [rec.ranks[(3, r)] for r in range(SILOS - 1)]
    assert (3, SILOS - 1) not in rec.ranks
    for node in (rec.ranks[(3, r)] for r in range(SILOS - 1)):  # round 2 changed no model
        state = rec.states[node]
        np.testing.assert_array_equal(npy_view(state[GOSSIP_STATE]["committed"]),
                                      rec.pending[(1, node)])


def test_a_round_that_fails_after_the_silos_mixed_changes_no_model(run_inprocess,
                                                                   store) -> None:
    """Round 2's exchange completes on every silo, but one silo's reply is lost: the round
    fails, and in round 3 the others train from their round-1 models, not round 2's."""
    rec = Recorder()
    lost: list[int] = []

    def lose_reply(rnd: int, rank: int, msg: Message, context: Context) -> Message | None:
        if rnd == 2 and rank == 0:
            lost.append(context.node_id)
            rec.app(msg, context)  # it mixes with the others, then its reply goes astray
            return Message(Error(0, "reply lost"), reply_to=msg)
        return None

    rec.fail = lose_reply
    summary = run_inprocess(gossip_scenario(rounds=3), grid=ConcurrentGrid(rec, SILOS))
    _, first, second, third = store.rounds(summary["run_id"])
    assert (first.status, second.status, third.status) == ("completed", "failed", "completed")
    for node in (rec.ranks[(3, r)] for r in range(SILOS - 1)):
        assert not np.array_equal(rec.pending[(2, node)], rec.pending[(1, node)])
        np.testing.assert_array_equal(npy_view(rec.states[node][GOSSIP_STATE]["committed"]),
                                      rec.pending[(1, node)])


def test_a_gossip_run_cannot_be_resumed(run_inprocess, store, db_url) -> None:
    from server.app import run_server
    from simulations.apps import build_task

    config = gossip_scenario(rounds=1)
    summary = run_inprocess(config, grid=ConcurrentGrid(Recorder(), SILOS))
    assert summary["status"] == "completed"
    assert store.load_checkpoint(summary["run_id"]) is None  # the models are on the silos
    with pytest.raises(ValueError, match="cannot be resumed"):
        run_server(ConcurrentGrid(Recorder(), SILOS), config, task=build_task(config),
                   store_url=db_url, resume=summary["run_id"])


@pytest.mark.parametrize(("values", "key"), [
    ({"secagg.enabled": True}, "secagg.enabled"),
    ({"dp.mode": "central", "dp.clip": 1.0, "dp.noise_multiplier": 1.0,
      "aggregation.weight_by": "uniform"}, "dp.mode"),
    ({"aggregation.combine": "median"}, "aggregation.combine"),
    ({"aggregation.server_opt": "fedadam"}, "aggregation.server_opt"),
    ({"driver.staleness": "polynomial"}, "driver.staleness"),
    ({"driver.target_accuracy": 0.9}, "driver.target_accuracy"),
    ({"compression.kind": "topk"}, "compression.kind"),
    ({"federation.clients": 1, "federation.min_clients": 1}, "federation.clients"),
    ({"federation.min_clients": 1}, "federation.min_clients"),
    ({"gossip.topology": "star"}, "gossip.topology"),
    ({"gossip.holdout_fraction": 0.2},
     "gossip.holdout_fraction moved to data.client_test_fraction"),
])
def test_gossip_refuses_what_needs_a_global_model(values: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_scenario("default", values={"driver.kind": "gossip", **values})


def test_the_default_scenario_resolves_with_gossip_defaults() -> None:
    config = load_scenario("default", values={"driver.kind": "gossip"})
    assert config["gossip"] == {"topology": "ring", "degree": 4}
    assert config["data"]["client_test_fraction"] == 0.2
