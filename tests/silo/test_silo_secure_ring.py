"""Secure cross-silo rounds on the in-process engine: SecAgg+ silos sum masked words over a ring.

The key and unmasking stages go through the server; the masked vectors only through the
ring, whose sum (mod 2^bits) is all the server's session ever receives. Distributed DP
noise rides under the masks and is charged per round; a silo dying in the ring fails the
round, and the next round runs without it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord
from silo_helpers import SILOS, join_then_die, scenario

from client.protocol.ring import CROSS_SILO_ACTION, RingRecord, RingSpec
from privacy.dp import DPConfig
from privacy.secagg import SecAggServer
from privacy.secagg.messages import read_header
from privacy.secagg.quantize import StatWords, max_level
from privacy.secagg.stages import MsgType
from server.config import FederationConfig
from server.dp import dp_controller
from server.secagg_config import SecAggScenarioConfig
from simulations.apps import spec_from_run_config
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask
from tests.recording_grid import RecordsReplies

pytestmark = pytest.mark.slow

SECURE = {"secagg.enabled": True}
RING_STAGE = f"query.{CROSS_SILO_ACTION}"


def silo_app() -> Callable[[Message, Context], Message]:
    return silo_client_app(ScenarioTask, spec_from_run_config)


def _spy_on_the_session(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record every message kind the server's SecAgg+ sessions receive, and every sum."""
    seen: dict[str, list] = {"kinds": [], "sums": []}
    receive, receive_sum = SecAggServer.receive, SecAggServer.receive_sum

    def spy_receive(self: SecAggServer, sender: int, payload: bytes) -> bool:
        seen["kinds"].append(read_header(payload).kind)
        return receive(self, sender, payload)

    def spy_sum(self: SecAggServer, senders: list[int], total: np.ndarray,
                failed: Any = None) -> bool:
        seen["sums"].append((sorted(senders), total.dtype, total.shape))
        return receive_sum(self, senders, total, failed)

    monkeypatch.setattr(SecAggServer, "receive", spy_receive)
    monkeypatch.setattr(SecAggServer, "receive_sum", spy_sum)
    return seen


class RecordingGrid(RecordsReplies, ConcurrentGrid):
    """The silos' engine, keeping every reply the server pulls."""


def test_the_unmasked_ring_sum_equals_the_plain_cross_silo_round(
        run_inprocess, store, monkeypatch: pytest.MonkeyPatch) -> None:
    plain_config, config = scenario(rounds=1), scenario(rounds=1, **SECURE)
    plain: list[np.ndarray] = []
    plain_run = run_inprocess(plain_config, grid=ConcurrentGrid(silo_app(), SILOS),
                              models=plain)
    seen = _spy_on_the_session(monkeypatch)
    models: list[np.ndarray] = []
    grid = RecordingGrid(silo_app(), SILOS)
    summary = run_inprocess(config, grid=grid, models=models)
    assert summary["status"] == "completed" and summary["versions"] == 1

    # within the fixed-point bound: each silo rounds w_i * delta_i to 1/scale
    weights = [len(ScenarioTask.from_config(config).partition(pid)[1]) for pid in range(SILOS)]
    settings = SecAggScenarioConfig(**config["secagg"])
    scale = settings.scale_for(SILOS, "examples")
    bound = SILOS * 0.5 / scale / sum(weights)
    assert np.abs(plain[1] - plain[0]).max() > 1e-3  # training moved the model
    np.testing.assert_array_equal(models[0], plain[0])
    np.testing.assert_allclose(models[1], plain[1], rtol=0, atol=bound + 1e-6)

    # the session got keys, shares and unmasking shares one by one, the vectors as one sum
    assert MsgType.MASKED_INPUT not in seen["kinds"]
    assert seen["kinds"].count(MsgType.UNMASK_RESPONSE) == SILOS
    dim = plain[0].size
    [(senders, dtype, shape)] = seen["sums"]
    # the coordinates, the weight and the stat words (values clipped, examples, loss)
    stats = StatWords(dim, max_level(settings.start_range, scale, settings.max_weight),
                      settings.max_weight).words
    assert len(senders) == SILOS and dtype.kind == "u" and shape == (dim + 1 + stats,)

    [_, rnd] = store.rounds(summary["run_id"])
    assert rnd.status == "completed" and rnd.num_accepted == SILOS
    assert rnd.metrics["ring_count"] == SILOS and rnd.metrics["ring_total_weight"] == sum(weights)
    # the round's loss from the ring's sum, as the plain round's mean of the silos' reports
    [_, plain_rnd] = store.rounds(plain_run["run_id"])
    assert rnd.metrics["train_loss"] == pytest.approx(plain_rnd.metrics["train_loss"], rel=1e-6)
    assert rnd.metrics["secagg_clipped"] == 0
    # and no silo's loss or example count reached the server in the clear
    clear = [(name, key) for reply in grid.replies if not reply.has_error()
             for name, record in reply.content.items()
             if isinstance(record, MetricRecord | ConfigRecord)
             for key in record if key in ("train_loss", "num-examples")]
    assert len(grid.replies) >= 4 * SILOS and clear == []
    [secure] = store.secagg_rounds(summary["run_id"])
    assert secure["status"] == "completed" and sorted(secure["survivors"]) == \
        sorted(str(s) for s in senders)


def test_distributed_dp_noise_rides_under_the_masks_and_each_round_is_charged(
        run_inprocess, store) -> None:
    config = scenario(rounds=2, **SECURE, **{
        "dp.mode": "distributed", "dp.clip": 0.5, "dp.noise_multiplier": 1.0,
        "aggregation.weight_by": "uniform"})
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app(), SILOS))
    assert summary["status"] == "completed" and summary["versions"] == 2
    assert summary["dp_mode"] == "distributed"

    # what the sync secure path charges: the plan's multiplier for the silos in the sum
    expected = dp_controller(DPConfig.from_dict(config["dp"]),
                             FederationConfig(**config["federation"]))
    dim = ScenarioTask.from_config(config).initial_params()[0].size
    plan = expected.plan_distributed(dim=dim, bits=config["secagg"]["bits"], max_clients=SILOS)
    z = plan.for_clients(SILOS).noise_multiplier_with(SILOS)
    ledger = store.privacy_ledger(summary["run_id"])
    assert [e["round"] for e in ledger] == [1, 2]
    for entry in ledger:
        expected.end_round(released=True, noise_multiplier=z)
        assert entry["mode"] == "distributed" and entry["noise_multiplier"] == pytest.approx(z)
        assert entry["epsilon"] == pytest.approx(expected.epsilon(), rel=1e-9)
        # against the server no amplification; every silo takes part in every round, so
        # nothing is sampled and the released model's figure would be the same one
        assert entry["protects_against"] == "server"
        assert entry["epsilon_model"] is None and expected.epsilon_model() is None
    assert 0 < ledger[0]["epsilon"] < ledger[1]["epsilon"] == pytest.approx(summary["epsilon"])
    rounds = store.rounds(summary["run_id"])[1:]
    assert [r.metrics["epsilon"] for r in rounds] == [e["epsilon"] for e in ledger]


def _dies_in_the_ring(release: threading.Event, victims: list[int]) -> Callable[
        [Message, Context], Message]:
    """Silo app whose last ring rank of round 1 joins the ring and dies there (its ring
    process exits; the silo never replies until released)."""
    app = silo_app()
    names = {f.name for f in dataclasses.fields(RingSpec)}

    def dying(msg: Message, context: Context) -> Message:
        ring = msg.content.get(RingRecord.SPEC)
        if (msg.metadata.message_type == RING_STAGE and msg.metadata.group_id == "1"
                and int(ring["rank"]) == SILOS - 1):
            victims.append(context.node_id)
            spec = {k: v for k, v in ring.items() if k in names}
            proc = multiprocessing.get_context("forkserver").Process(target=join_then_die,
                                                                     args=(spec,))
            proc.start()
            proc.join(60)
            release.wait(120)
            raise RuntimeError("released at the end of the test")
        return app(msg, context)

    return dying


def test_a_silo_dying_in_the_secure_ring_fails_the_round_and_the_next_goes_on(
        run_inprocess, store) -> None:
    release, victims = threading.Event(), []
    config = scenario(rounds=2, **SECURE, **{"secagg.bits": 24, "silo.join_timeout_s": 5.0,
                                             "silo.ring_timeout_s": 2.0})
    models: list[np.ndarray] = []
    try:
        summary = run_inprocess(config, grid=ConcurrentGrid(_dies_in_the_ring(release, victims),
                                                            SILOS), models=models)
    finally:
        release.set()
    run_id = summary["run_id"]
    [victim] = victims
    _, first, second = store.rounds(run_id)
    assert first.status == "failed" and first.model_version == 0
    np.testing.assert_array_equal(models[1], models[0])
    updates = {u.client_id: u for _, u in store.updates(run_id, round=1)}
    assert updates[str(victim)].fate == "dropped"
    assert "hung or died" in updates[str(victim)].reason
    others = [u for cid, u in updates.items() if cid != str(victim)]
    assert len(others) == SILOS - 1 and all(u.fate == "rejected" for u in others)
    assert all("ring failed" in u.reason for u in others), [u.reason for u in others]
    secure = store.secagg_rounds(run_id)
    assert secure[0]["status"] == "aborted" and "ring failed" in secure[0]["abort_reason"]

    # round 2: the two others are fewer than secagg.min_survivors = 3: no session starts,
    # no ring is formed and no sum is revealed; the run goes on
    assert second.status == "aborted" and second.num_accepted == 0
    assert str(victim) not in {u.client_id for _, u in store.updates(run_id, round=2)}
    assert secure[1]["status"] == "aborted" and secure[1]["survivors"] == []
    assert "at least secagg.min_survivors = 3 participants per round, got 2" in \
        secure[1]["abort_reason"]
    np.testing.assert_array_equal(models[2], models[0])
    assert summary["versions"] == 0
