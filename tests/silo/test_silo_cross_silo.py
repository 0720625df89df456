"""Cross-silo rounds on the in-process engine: silos on threads, each ring in real processes.

The server applies the weighted mean the silos computed over the ring, checks every
silo's digest against it, fails a round whose silos disagree or do not all arrive, and
goes on without the silo to blame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from silo_helpers import SILOS, expected_first_round, scenario, survivors_of_a_dead_peer

from aggregation.ring import RingError
from client.protocol.ring import RingRecord
from client.protocol.updates import delta_record, read_delta
from client.silo.ring import blamed_ranks, ring_aggregate
from server.cross_silo import judge
from simulations.apps import client_app as plain_client_app
from simulations.apps import spec_from_run_config
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask

pytestmark = pytest.mark.slow


def silo_app() -> Callable[[Message, Context], Message]:
    return silo_client_app(ScenarioTask, spec_from_run_config)


def ring_of(msg: Message) -> tuple[int, int]:
    """(server round, ring rank) of a cross-silo message."""
    ring = msg.content[RingRecord.SPEC]
    return int(msg.content["config"]["server-round"]), int(ring["rank"])


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "round_robin"])
def test_the_round_applies_the_weighted_mean_of_the_silos_deltas(run_inprocess, store,
                                                                 algorithm: str) -> None:
    config = scenario(rounds=1, **{"silo.algorithm": algorithm})
    assert config["silo"]["algorithm"] == algorithm
    models: list[np.ndarray] = []
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app(), SILOS), models=models)
    assert summary["status"] == "completed" and summary["versions"] == 1
    initial, expected = expected_first_round(config)
    np.testing.assert_array_equal(models[0], initial)
    np.testing.assert_allclose(models[1] - initial, expected, atol=2e-6)
    weights = [len(ScenarioTask.from_config(config).partition(pid)[1]) for pid in range(SILOS)]

    [_, rnd] = store.rounds(summary["run_id"])
    assert rnd.status == "completed" and rnd.num_accepted == SILOS and rnd.num_sampled == SILOS
    assert rnd.metrics["ring_total_weight"] == sum(weights)
    assert rnd.metrics["ring_count"] == SILOS and rnd.metrics["ring_failed"] == 0
    updates = [u for _, u in store.updates(summary["run_id"], round=1)]
    assert sorted(u.weight for u in updates) == sorted(float(w) for w in weights)


def _lie_about(kind: str) -> Callable[[Message, Context], Message]:
    """Silo app where, in round 1, a non-leader reports a wrong digest ("digest") or the
    leader sends a changed aggregate ("aggregate")."""
    app = silo_app()

    def lying(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        rnd, rank = ring_of(msg)
        if rnd != 1 or reply.has_error():
            return reply
        if kind == "digest" and rank == 1:
            reply.content[RingRecord.RESULT]["digest"] = "0" * 64
        if kind == "aggregate" and rank == 0:
            tampered = np.array(read_delta(reply.content[RingRecord.AGGREGATE])) + 1e-3
            reply.content[RingRecord.AGGREGATE] = delta_record(tampered.astype(np.float32))
        return reply

    return lying


@pytest.mark.parametrize("kind", ["digest", "aggregate"])
def test_a_digest_mismatch_fails_the_round_and_the_next_goes_on_without_the_silo(
        run_inprocess, store, kind: str) -> None:
    models: list[np.ndarray] = []
    summary = run_inprocess(scenario(rounds=2), grid=ConcurrentGrid(_lie_about(kind), SILOS),
                            models=models)
    run_id = summary["run_id"]
    _, first, second = store.rounds(run_id)
    assert first.status == "failed" and first.model_version == 0
    np.testing.assert_array_equal(models[1], models[0])  # the model is unchanged
    blamed = [u for _, u in store.updates(run_id, round=1) if "differs" in (u.reason or "")]
    assert len(blamed) == 1 and blamed[0].fate == "rejected"
    assert ("aggregate's sha256" in blamed[0].reason) == (kind == "aggregate")
    assert second.status == "completed" and second.num_sampled == SILOS - 1
    later = {u.client_id for _, u in store.updates(run_id, round=2)}
    assert blamed[0].client_id not in later and len(later) == SILOS - 1
    assert summary["status"] == "completed" and summary["versions"] == 1


def _hanging(release: threading.Event, hung: list[int]) -> Callable[[Message, Context],
                                                                    Message]:
    """Silo app whose last ring rank of round 1 never reaches the ring (until released)."""
    app = silo_app()

    def hanging(msg: Message, context: Context) -> Message:
        rnd, rank = ring_of(msg)
        if rnd == 1 and rank == SILOS - 1:
            hung.append(context.node_id)
            release.wait(120)
            raise RuntimeError("released at the end of the test")
        return app(msg, context)

    return hanging


TIMEOUTS = {"silo.join_timeout_s": 2.0, "silo.ring_timeout_s": 2.0}


def test_a_silo_that_hangs_fails_the_round_before_the_deadline(run_inprocess, store) -> None:
    release, hung = threading.Event(), []
    config = scenario(rounds=2, **TIMEOUTS)
    try:
        summary = run_inprocess(config, grid=ConcurrentGrid(_hanging(release, hung), SILOS))
    finally:
        release.set()
    run_id = summary["run_id"]
    _, first, second = store.rounds(run_id)
    assert first.status == "failed" and first.num_replies == SILOS - 1
    assert first.wall_s < config["federation"]["round_timeout_s"]  # it did not wait it out
    updates = {u.client_id: u for _, u in store.updates(run_id, round=1)}
    [node] = hung
    assert updates[str(node)].fate == "dropped" and "hung or died" in updates[str(node)].reason
    others = [u for cid, u in updates.items() if cid != str(node)]
    assert all(f"rank(s) [{SILOS - 1}]" in u.reason and "did not join" in u.reason
               for u in others), [u.reason for u in others]
    assert second.status == "completed" and second.num_accepted == SILOS - 1
    assert str(node) not in {u.client_id for _, u in store.updates(run_id, round=2)}


def test_the_run_stops_when_too_few_silos_are_left(run_inprocess, store) -> None:
    release, hung = threading.Event(), []
    config = scenario(rounds=3, **TIMEOUTS, **{"federation.min_clients": SILOS})
    try:
        summary = run_inprocess(config, grid=ConcurrentGrid(_hanging(release, hung), SILOS))
    finally:
        release.set()
    assert summary["status"] == "stopped" and summary["rounds"] == 1
    assert f"{SILOS - 1} silo(s) left after excluding [{hung[0]}]" in summary["stop_reason"]
    assert [r.status for r in store.rounds(summary["run_id"])] == ["completed", "failed"]


# The healthy silos reach the rendezvous more than TRAIN_S after a non-silo's error reply,
# later than ring_timeout_s + 5 s (all the server used to wait after a failure), and give
# up join_timeout_s later: beyond failure_grace_s after the error, so the server must count
# their grace from their arrival at the rendezvous.
NO_SILO = {"silo.join_timeout_s": 8.0, "silo.ring_timeout_s": 1.0,
           "federation.round_timeout_s": 60.0}
TRAIN_S = 6.5


def test_a_node_that_is_no_silo_is_the_only_one_excluded(run_inprocess, store) -> None:
    """Two silos and a node serving the plain ClientApp, which answers train.cross_silo with
    an error at once. The silos train slowly, then wait for it at the rendezvous and report
    that its ring rank did not join; they are not blamed, and round 2 runs with them."""
    silo, non_silo = silo_app(), []

    def mixed(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == SILOS - 1:
            non_silo.append(context.node_id)
            return plain_client_app(msg, context)
        if ring_of(msg)[0] == 1:
            time.sleep(TRAIN_S)
        return silo(msg, context)

    config = scenario(rounds=2, **NO_SILO)
    summary = run_inprocess(config, grid=ConcurrentGrid(mixed, SILOS))
    run_id = summary["run_id"]
    _, first, second = store.rounds(run_id)
    assert first.status == "failed" and first.num_replies == SILOS  # every silo reported
    assert first.wall_s >= TRAIN_S + NO_SILO["silo.join_timeout_s"]  # the server waited
    updates = {u.client_id: u for _, u in store.updates(run_id, round=1)}
    bad = str(non_silo[0])
    assert updates[bad].fate == "rejected" and "silo error" in updates[bad].reason
    healthy = [u for cid, u in updates.items() if cid != bad]
    assert len(healthy) == SILOS - 1
    assert all(u.fate == "rejected" and "did not join" in u.reason for u in healthy)
    assert first.metrics["ring_excluded"] == 1
    assert second.status == "completed" and second.num_accepted == SILOS - 1
    assert {u.client_id for _, u in store.updates(run_id, round=2)} == {u.client_id
                                                                         for u in healthy}
    assert (summary["status"], summary["versions"]) == ("completed", 1)


def _reply(status: str, peers: list[int]) -> Message:
    result = ConfigRecord({"status": status, "peers": peers, "error": "ring rendezvous"})
    return Message(RecordDict({RingRecord.RESULT: result, "metrics": MetricRecord()}), 0, "train")


@pytest.mark.parametrize(("joined", "peers", "blamed"), [
    ({11, 12}, [0], {10}),  # 12 joined and no report names it: silent, not to blame
    ({11}, [0], {10, 12}),  # 12 never reached the rendezvous
    ({11, 12}, [0, 2], {10, 12}),  # 12 joined, but its peer names it (hung in the ring)
])
def test_a_silent_silo_is_blamed_only_if_it_did_not_join_or_a_peer_names_it(
        joined: set[int], peers: list[int], blamed: set[int]) -> None:
    order = [10, 11, 12]  # 10 fails on its own; 11 reports the ranks in peers; 12 is silent
    error = Message(Error(0, "not a silo"), reply_to=_reply("ok", []))
    outcome = judge(order, {10: error, 11: _reply("ring-timeout", peers)}, dim=4,
                    joined=joined)
    assert not outcome.completed and set(outcome.blamed) == blamed
    silent = next(r for r in outcome.records(version=0) if r.client_id == "12")
    assert silent.fate == "dropped"
    assert ("not excluded" in silent.reason) == (12 not in blamed)


def test_a_silo_rejects_its_own_bad_update_and_the_ring_goes_on(run_inprocess, store) -> None:
    app = silo_app()

    def strict(msg: Message, context: Context) -> Message:
        if ring_of(msg)[1] == 1:  # this silo checks its delta against a tiny norm bound
            ring = msg.content[RingRecord.SPEC]
            msg.content[RingRecord.SPEC] = ConfigRecord({**ring, "max_norm": 1e-6})
        return app(msg, context)

    summary = run_inprocess(scenario(rounds=1), grid=ConcurrentGrid(strict, SILOS))
    [_, rnd] = store.rounds(summary["run_id"])
    assert rnd.status == "completed" and rnd.num_accepted == SILOS - 1
    assert rnd.num_rejected == 1 and rnd.metrics["ring_count"] == SILOS - 1
    [rejected] = [u for _, u in store.updates(summary["run_id"], round=1)
                  if u.fate == "rejected"]
    assert "exceeds aggregation.max_norm" in rejected.reason


def test_a_silo_dying_in_the_ring_ends_it_with_an_error_naming_it() -> None:
    errors, victim, threads = survivors_of_a_dead_peer(
        lambda spec: ring_aggregate(np.ones(50_000, np.float32), 1.0, spec))
    assert not any(t.is_alive() for t in threads), "a survivor hangs"
    assert victim.exitcode == 1
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, RingError) for e in errors.values()), errors
    assert any(2 in blamed_ranks(e) for e in errors.values()), {r: str(e) for r, e in
                                                              errors.items()}


def test_silos_answer_sync_rounds_like_plain_clients(run_inprocess) -> None:
    config = scenario(rounds=1, **{"driver.kind": "sync"})
    plain: list[np.ndarray] = []
    silos: list[np.ndarray] = []
    run_inprocess(config, models=plain)  # fedring's ClientApp, one message at a time
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app(), SILOS), models=silos)
    assert summary["status"] == "completed" and len(silos) == len(plain) == 2
    assert np.abs(plain[-1] - plain[0]).max() > 1e-3
    np.testing.assert_allclose(silos[-1], plain[-1], atol=1e-6)
