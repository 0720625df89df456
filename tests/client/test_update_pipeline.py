"""The client's post-training pipeline (``client.update_pipeline``): each client kind's
steps, in order, for its config; each step doing its one thing; and the replies of a real
fedring client and a real silo under FedBN, local DP and an attack, step by step."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from flwr.app import RecordDict

from aggregation.centered import clip_around
from client import update_pipeline
from client.flat_model import FlatModel
from client.local_state import local_spans
from client.momentum import momentum_update
from client.protocol.train import train_config
from client.protocol.updates import model_record, read_delta
from client.task import ATTACKER_METRIC
from client.update_pipeline import (
    ClientClip,
    ClientMomentum,
    ClientPipeline,
    FedBNZero,
    LocalDP,
    PostTraining,
    Tamper,
    fedring_pipeline,
    silo_pipeline,
)
from privacy.dp import local_dp_update
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.module_task import make_task
from simulations.silo_engine import silo_client_app
from simulations.task import ScenarioTask, task_spec

BN = ["model.kind=bn_mlp", "model.hidden=[16]"]
LOCAL_DP = ["dp.mode=local", "dp.clip=0.5", "dp.noise_multiplier=0.1",
            "aggregation.weight_by=uniform"]
ATTACK = ["attack.fraction=1.0", "attack.kind=scale", "attack.scale=10"]
CLIP, Z, SCALE = 0.5, 0.1, 10.0


def spec_of(*overrides: str) -> dict[str, Any]:
    return task_spec(load_scenario("default", ["federation.clients=2", "train.local_epochs=1",
                                               *overrides]))


def update(delta: list[float] | np.ndarray, **kw: Any) -> PostTraining:
    return PostTraining(np.asarray(delta, dtype=np.float32), {}, partition_id=kw.pop("pid", 3),
                        seed=kw.pop("seed", 11), state=kw.pop("state", RecordDict()))


# --- each kind's steps, in order ---------------------------------------------------------

def test_fedring_steps_follow_the_task_and_the_round_config():
    task = make_task(spec_of(*BN, *LOCAL_DP, *ATTACK))
    spans = local_spans(FlatModel(task.build_model()))
    dim = FlatModel(task.build_model()).dim
    plain = train_config(1, 0, "{}", 0)
    assert fedring_pipeline(task, plain, local=spans, dim=dim).names == (
        "fedbn_zero", "local_dp", "tamper")
    assert fedring_pipeline(task, plain, local=None, dim=dim).names == ("local_dp", "tamper")
    every = train_config(1, 0, "{}", 0, client_momentum=0.5,
                         center=(np.zeros(dim, np.float32), 1.0))
    assert fedring_pipeline(task, every, local=spans, dim=dim).names == (
        "fedbn_zero", "local_dp", "client_momentum", "tamper", "client_clip")
    bare = make_task(spec_of())
    assert fedring_pipeline(bare, plain, local=None, dim=dim).names == ("tamper",)


def test_a_silo_has_no_momentum_nor_client_side_clipping():
    task = make_task(spec_of(*BN, *LOCAL_DP))
    spans = local_spans(FlatModel(task.build_model()))
    assert silo_pipeline(task, local=None).names == ("local_dp", "tamper")
    assert silo_pipeline(task, local=spans).names == ("fedbn_zero", "local_dp", "tamper")
    assert silo_pipeline(make_task(spec_of()), local=None).names == ("tamper",)


# --- each step's one thing ---------------------------------------------------------------

def test_fedbn_zero_zeroes_only_the_local_spans():
    u = update([1, 2, 3, 4, 5])
    FedBNZero([("bn.weight", slice(1, 2)), ("bn.bias", slice(3, 5))])(u)
    np.testing.assert_array_equal(u.delta, [1, 0, 3, 0, 0])
    assert not u.noised and not u.tampered and u.metrics == {}


def test_local_dp_clips_then_adds_the_noise():
    u = update([3.0, 4.0])  # norm 5: clipped to 0.5
    LocalDP(CLIP, Z, np.random.default_rng(5))(u)
    want, _ = local_dp_update(np.array([3.0, 4.0], np.float32), CLIP, Z,
                              np.random.default_rng(5))
    np.testing.assert_array_equal(u.delta, want)
    assert u.noised and not u.tampered
    quiet = update([3.0, 4.0])
    LocalDP(CLIP, 0.0, np.random.default_rng(5))(quiet)
    np.testing.assert_allclose(quiet.delta, [0.3, 0.4], rtol=1e-6)


def test_client_momentum_replaces_the_delta_by_the_nodes_momentum():
    state = RecordDict()
    momentum_update(state, np.array([4.0, 0.0], np.float32), 0.5)  # an earlier round
    u = update([0.0, 2.0], state=state)
    ClientMomentum(0.5)(u)
    np.testing.assert_array_equal(u.delta, [2.0, 1.0])
    assert u.noised


def test_tamper_forges_and_marks_only_an_attacker():
    calls = []

    def attack(pid: int, delta: np.ndarray, seed: int) -> bool:
        calls.append((pid, seed))
        if pid == 3:
            delta *= -1
        return pid == 3

    u = update([1.0, -2.0], pid=3, seed=11)
    Tamper(attack)(u)
    np.testing.assert_array_equal(u.delta, [-1.0, 2.0])
    assert u.tampered and u.noised and u.metrics == {ATTACKER_METRIC: 1}
    unmarked = update([1.0], pid=3)
    Tamper(attack, mark=False)(unmarked)
    assert unmarked.tampered and unmarked.metrics == {}
    honest = update([1.0], pid=4)
    Tamper(attack)(honest)
    assert not honest.tampered and not honest.noised and honest.metrics == {}
    assert calls == [(3, 11), (3, 11), (4, 11)]


def test_client_clip_clips_around_the_centre():
    center = np.array([1.0, 1.0], np.float32)
    u = update([4.0, 5.0])
    ClientClip(center, 1.0)(u)
    np.testing.assert_array_equal(u.delta, clip_around(np.array([4.0, 5.0], np.float32),
                                                       center, 1.0))
    assert np.linalg.norm(u.delta - center) == pytest.approx(1.0, rel=1e-6) and u.noised


def test_the_pipeline_runs_its_steps_in_order():
    order = []

    class Note:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, u: PostTraining) -> None:
            order.append(self.name)
            u.delta = u.delta * 2 + 1

    pipe = ClientPipeline([Note("a"), None, Note("b")])
    assert pipe.names == ("a", "b")
    assert pipe.run(update([1.0])).delta.tolist() == [7.0]  # (1*2+1)*2+1
    assert order == ["a", "b"]


# --- the real clients, step by step ------------------------------------------------------

def replies(app: Any, spec: dict[str, Any], *, fedbn: bool) -> dict[int, tuple[np.ndarray, dict]]:
    """Each of two nodes' round-1 delta and metrics from ``app`` (by node id: partition + 1)."""
    params, layout = ScenarioTask(spec).initial_params()
    grid = InProcessGrid(app, 2)
    config = train_config(1, 0, json.dumps(spec, sort_keys=True), 0, local_buffers=fedbn)
    msgs = [grid.create_message(RecordDict({"arrays": model_record(layout, params),
                                            "config": config}), "train", n, "1")
            for n in grid.get_node_ids()]
    out = {}
    for m in grid.send_and_receive(msgs):
        assert not m.has_error(), m.error
        delta = read_delta(m.content["delta"]).copy()
        out[m.metadata.src_node_id] = (delta, dict(m.content["metrics"]))
    return out


def expected(raw: np.ndarray, spans: list[tuple[str, slice]]) -> np.ndarray:
    """What fedbn_zero -> local_dp -> tamper (scale by 10) make of ``raw``."""
    d = raw.copy()
    for _, span in spans:
        d[span] = 0.0
    d, _ = local_dp_update(d, CLIP, Z, np.random.default_rng(7))
    return d * np.float32(SCALE)


@pytest.mark.parametrize("kind", ["fedring", "silo"])
def test_fedbn_then_local_dp_then_the_attack(kind, monkeypatch):
    """A client's reply under FedBN, local DP and a scaling attacker is its plain delta
    with the batch-norm entries zeroed, then clipped and noised, then scaled."""
    monkeypatch.setattr(update_pipeline, "noise_rng", lambda: np.random.default_rng(7))
    app = client_app if kind == "fedring" else silo_client_app(make_task, lambda rc: {})
    plain = replies(app, spec_of(*BN), fedbn=False)
    app = client_app if kind == "fedring" else silo_client_app(make_task, lambda rc: {})
    spec = spec_of(*BN, *LOCAL_DP, *ATTACK)
    every = replies(app, spec, fedbn=True)
    spans = local_spans(FlatModel(make_task(spec).build_model()))
    assert spans and set(every) == set(plain)
    for node, (delta, metrics) in every.items():
        raw = plain[node][0]
        assert np.abs(raw[spans[0][1]]).max() > 0  # the zeroing is not vacuous
        np.testing.assert_array_equal(delta, expected(raw, spans))
        # a silo does not mark its forged update (as before the pipeline)
        assert metrics.get(ATTACKER_METRIC) == (1 if kind == "fedring" else None)
