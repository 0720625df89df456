"""Centered clipping on the clients under secure aggregation: the centre on the wire, the
client's step, and whole SecAgg+ runs where the server only learns the sum."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey
from client.protocol.train import read_center, train_config
from client.protocol.updates import model_record, read_delta
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask, task_spec

SECURE = ["federation.clients=5", "train.local_epochs=1", "secagg.enabled=true",
          "aggregation.combine=centered_clip"]


def test_the_centre_travels_in_the_train_config():
    center = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    config = train_config(1, 0, "{}", 0, center=(center, 0.75))
    got, radius = read_center(config, 3)
    np.testing.assert_array_equal(got, center)
    assert radius == 0.75
    assert read_center(train_config(1, 0, "{}", 0), 3) is None


@pytest.mark.parametrize(("entries", "match"), [
    ({ConfigKey.CENTER: b"\0" * 8, ConfigKey.CLIP_RADIUS: 1.0}, "must be 12 bytes"),
    ({ConfigKey.CENTER: "abc", ConfigKey.CLIP_RADIUS: 1.0}, "must be 12 bytes"),
    ({ConfigKey.CENTER: b"\0" * 12, ConfigKey.CLIP_RADIUS: 0.0}, "must be a number > 0"),
    ({ConfigKey.CENTER: b"\0" * 12}, "must be a number > 0"),
    ({ConfigKey.CENTER: np.full(3, np.nan, "<f4").tobytes(), ConfigKey.CLIP_RADIUS: 1.0},
     "NaN or Inf"),
])
def test_a_malformed_centre_is_refused(entries, match):
    with pytest.raises(WireError, match=match):
        read_center(ConfigRecord(entries), 3)


def reply_delta(spec: dict, center: tuple[np.ndarray, float] | None) -> np.ndarray:
    task = ScenarioTask(spec)
    params, layout = task.initial_params()
    config = train_config(1, 0, json.dumps(spec, sort_keys=True), 0, center=center)
    grid = InProcessGrid(client_app, spec["clients"])
    msg = grid.create_message(RecordDict({"arrays": model_record(layout, params),
                                          "config": config}), "train", 1, group_id="1")
    [reply] = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error
    return read_delta(reply.content["delta"]).copy()


def test_the_client_sends_its_delta_clipped_around_the_centre():
    spec = task_spec(load_scenario("default", ["federation.clients=4", "train.local_epochs=1"]))
    honest = reply_delta(spec, None)
    rng = np.random.default_rng(0)
    center = (0.01 * rng.standard_normal(honest.size)).astype(np.float32)
    diff = honest.astype(np.float64) - center
    radius = 0.25 * float(np.linalg.norm(diff))  # clips
    sent = reply_delta(spec, (center, radius))
    np.testing.assert_allclose(sent, center + diff * (radius / np.linalg.norm(diff)),
                               atol=1e-6)
    assert np.linalg.norm(sent.astype(np.float64) - center) == pytest.approx(radius, rel=1e-5)
    far = reply_delta(spec, (center, 1e6))  # inside the radius: unchanged
    np.testing.assert_allclose(far, honest, atol=1e-7)


def test_secure_run_applies_the_mean_of_the_clipped_updates(run_inprocess, store):
    """Round 1 is centred on 0, so every client sends at most the radius: the applied mean
    is within it; round 2 is centred on round 1's aggregate, which the checkpoint keeps."""
    radius = 0.05
    models: list[np.ndarray] = []
    cfg = load_scenario("default", [*SECURE, "federation.rounds=2",
                                    f"aggregation.clip_radius={radius}",
                                    "federation.checkpoint_every=1"])
    summary = run_inprocess(cfg, models=models)
    assert summary["status"] == "completed" and len(models) == 3
    step1, step2 = models[1] - models[0], models[2] - models[1]
    quantum = 1e-3  # the fixed-point error of 5 clients' sum, far below the radius here
    assert np.linalg.norm(step1) <= radius + quantum
    # round 2: each client sent v + clip(delta - v) with v = step1: within radius of v
    assert np.linalg.norm(step2 - step1) <= radius + quantum
    free: list[np.ndarray] = []
    run_inprocess(load_scenario("default", [*SECURE[:2], "federation.rounds=1"]), models=free)
    assert np.linalg.norm(free[1] - free[0]) > 10 * radius  # without clipping: much larger
    ckpt = store.load_checkpoint(summary["run_id"])
    np.testing.assert_allclose(ckpt.state["pipeline"]["center"], step2, atol=1e-6)


def test_secure_run_with_distributed_dp_and_client_side_clipping(run_inprocess):
    cfg = load_scenario("default", [*SECURE, "federation.rounds=1",
                                    "aggregation.clip_radius=0.5",
                                    "aggregation.weight_by=uniform", "dp.mode=distributed",
                                    "dp.clip=0.5", "dp.noise_multiplier=0.5",
                                    "train.batch_size=64"])
    summary = run_inprocess(cfg)
    assert summary["status"] == "completed" and summary["epsilon"] > 0
