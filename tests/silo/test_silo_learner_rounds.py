"""Silo rounds whose silos train SMA learners (``silo.learners`` = 2), on the in-process
engine: plain and secure cross-silo rounds apply the mean of the silos' average-model
deltas (gossip: ``test_silo_gossip``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Context, Message
from silo_helpers import SILOS, scenario, trained_silo

from client.app import training_seed
from client.flat_model import FlatModel
from client.protocol.learners import LearnerKey, LearnerSpec
from client.silo.learners import LearnerState, train_learners
from server.secagg_config import SecAggScenarioConfig
from simulations.apps import spec_from_run_config
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask

pytestmark = pytest.mark.slow
KEYS = (LearnerKey.LEARNERS, LearnerKey.MOMENTUM, LearnerKey.CORRECTION)
LEARNERS = {"silo.learners": 2, "silo.sma_momentum": 0.5, "silo.sma_correction": 0.2}


def silo_app(seen: list[dict]) -> Callable[[Message, Context], Message]:
    """The silo app, noting the learner keys of every training message it gets."""
    app = silo_client_app(ScenarioTask, spec_from_run_config)

    def noting(msg: Message, context: Context) -> Message:
        config = msg.content.get("config")
        if config is not None and msg.metadata.message_type.startswith("train"):
            seen.append({k: config.get(k) for k in KEYS})
        return app(msg, context)

    return noting


def expected_model(config: dict) -> tuple[np.ndarray, np.ndarray]:
    """The initial model and the examples-weighted mean of the silos' SMA deltas."""
    task = ScenarioTask.from_config(config)
    initial, _ = task.initial_params()
    deltas = [trained_silo(config, initial, pid, 1) - initial for pid in range(SILOS)]
    weights = [len(task.partition(pid)[1]) for pid in range(SILOS)]
    return initial, np.average(np.stack(deltas), axis=0, weights=weights)


def test_a_cross_silo_round_applies_the_mean_of_the_average_models_deltas(run_inprocess
                                                                          ) -> None:
    config = scenario(rounds=1, **LEARNERS)
    seen: list[dict] = []
    models: list[np.ndarray] = []
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app(seen), SILOS), models=models)
    assert summary["status"] == "completed" and summary["versions"] == 1
    initial, expected = expected_model(config)
    ddp = scenario(rounds=1)
    _, one_learner = expected_model(ddp)
    assert np.abs(expected - one_learner).max() > 1e-3  # learners change the outcome
    np.testing.assert_allclose(models[1] - initial, expected, atol=2e-6)
    assert seen == [{LearnerKey.LEARNERS: 2, LearnerKey.MOMENTUM: 0.5,
                     LearnerKey.CORRECTION: 0.2}] * SILOS


def test_two_cross_silo_rounds_carry_each_silos_learners(run_inprocess) -> None:
    """Round 2 starts each silo's learners at the new global model plus their offsets
    from the silo's average model at the end of round 1 (and their momentum): the same
    as every silo's learners carried across both rounds here."""
    config = scenario(rounds=2, **LEARNERS)
    models: list[np.ndarray] = []
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app([]), SILOS), models=models)
    assert summary["status"] == "completed" and summary["versions"] == 2
    task = ScenarioTask.from_config(config)
    spec = LearnerSpec(2, momentum=0.5, correction=0.2)
    states = [LearnerState() for _ in range(SILOS)]
    weights = [len(task.partition(pid)[1]) for pid in range(SILOS)]
    model = FlatModel(task.build_model())
    glob, _ = task.initial_params()
    fresh = None
    for rnd in (1, 2):
        deltas = []
        for pid in range(SILOS):
            model.load(glob)
            x, y = task.partition(pid)
            train_learners(model.module, x, y, task.train_config, spec,
                           seed=training_seed(task.seed, rnd, pid), state=states[pid])
            deltas.append(model.flat_np - glob)
        if rnd == 2:  # without the states: what restarting the learners gives
            model.load(glob)
            x, y = task.partition(0)
            train_learners(model.module, x, y, task.train_config, spec,
                           seed=training_seed(task.seed, rnd, 0))
            fresh = model.flat_np - glob
        glob = glob + np.average(np.stack(deltas), axis=0, weights=weights).astype(np.float32)
        np.testing.assert_allclose(models[rnd], glob, atol=5e-6)
    assert np.abs(fresh - deltas[0]).max() > 1e-4  # carrying the learners changes round 2


def test_a_secure_cross_silo_round_unmasks_the_same_model(run_inprocess) -> None:
    config = scenario(rounds=1, **LEARNERS, **{"secagg.enabled": True})
    seen: list[dict] = []
    models: list[np.ndarray] = []
    summary = run_inprocess(config, grid=ConcurrentGrid(silo_app(seen), SILOS), models=models)
    assert summary["status"] == "completed" and summary["versions"] == 1
    initial, expected = expected_model(config)
    weights = [len(ScenarioTask.from_config(config).partition(pid)[1]) for pid in range(SILOS)]
    scale = SecAggScenarioConfig(**config["secagg"]).scale_for(SILOS, "examples")
    bound = SILOS * 0.5 / scale / sum(weights)  # each silo rounds w_i * delta_i to 1/scale
    np.testing.assert_allclose(models[1] - initial, expected, rtol=0, atol=bound + 2e-6)
    trained = [s for s in seen if s[LearnerKey.LEARNERS] is not None]
    assert len(trained) == SILOS and all(s[LearnerKey.LEARNERS] == 2 for s in trained)


@pytest.mark.parametrize("values, key", [
    ({"silo.learners": 0}, "silo.learners"),
    ({"silo.learners": 1.5}, "silo.learners"),
    ({"silo.sma_momentum": 1.0}, "silo.sma_momentum"),
    ({"silo.sma_momentum": -0.1}, "silo.sma_momentum"),
    ({"silo.sma_correction": 0.0}, "silo.sma_correction"),
    ({"silo.sma_correction": 1.5}, "silo.sma_correction"),
    ({"silo.learners": 4, "silo.sma_correction": 0.3}, "silo.sma_correction"),
])
def test_bad_learner_settings_fail_at_start_naming_the_key(values: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        scenario(rounds=1, **values)


@pytest.mark.parametrize("values, key", [
    ({"train.optimizer": "adam"}, "train.optimizer"),
    ({"train.proximal_mu": 0.1}, "train.proximal_mu"),
])
def test_training_settings_learners_cannot_honour_fail_at_start(run_inprocess, values: dict,
                                                               key: str) -> None:
    config = scenario(rounds=1, **LEARNERS, **values)
    seen: list[dict] = []
    with pytest.raises(ValueError, match=key):
        run_inprocess(config, grid=ConcurrentGrid(silo_app(seen), SILOS))
    assert seen == []  # no silo got a training message
