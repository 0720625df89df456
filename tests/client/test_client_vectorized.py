"""The in-process engine's cohorts (client.batched_training, client.vectorized): one batched
computation gives what training the clients one after the other gives, and what cannot be
batched falls back with a log line; trained back to back, a cohort gives exactly what the
ClientApp gives training each client as its message comes."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message, RecordDict

from client.batched_training import CohortClient, batch_plan, train_cohort
from client.flat_model import FlatModel
from client.protocol.train import train_config
from client.protocol.updates import model_record
from client.training import TrainConfig, train
from server.replies import decode_train_reply
from simulations.apps import client_app, cohort_hook
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask

CONFIGS = [TrainConfig(lr=0.05, batch_size=8, local_epochs=2),
           TrainConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=8, local_epochs=2),
           TrainConfig(optimizer="adam", lr=0.01, weight_decay=1e-3, batch_size=8,
                       local_epochs=2)]


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(5, 16),
                                         torch.nn.ReLU(), torch.nn.Linear(16, 3)))


def _clients() -> list[CohortClient]:
    gen = torch.Generator().manual_seed(1)
    # uneven sizes: 5 steps, 3 (a short last batch), 8, and one step of 5 examples
    return [CohortClient(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,),
                                                                         generator=gen), seed=i)
            for i, n in enumerate([40, 23, 57, 5])]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["sgd", "momentum", "adam"])
def test_a_cohort_trains_each_client_as_sequential_training_does(cfg: TrainConfig) -> None:
    model = _model()
    start = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    params, losses = train_cohort(model.module, start, _clients(), cfg)
    for i, c in enumerate(_clients()):
        alone = _model()
        loss = train(alone.module, c.x, c.y, cfg, seed=c.seed)
        for name, p in alone.module.named_parameters():
            torch.testing.assert_close(params[name][i], p.detach(), rtol=1e-5, atol=1e-6)
        assert losses[i] == pytest.approx(loss, rel=1e-5)


def test_the_batch_plan_is_each_clients_seeded_order_padded_and_masked() -> None:
    cfg = TrainConfig(batch_size=8, local_epochs=2)
    index, mask, steps = batch_plan(_clients(), cfg)
    assert steps.tolist() == [10, 6, 16, 2] and index.shape == (4, 16, 8)
    gen = torch.Generator().manual_seed(_clients()[1].seed)
    first = torch.randperm(23, generator=gen)
    assert index[1, 0].tolist() == first[:8].tolist()
    assert mask[1, 2].tolist() == [1.0] * 7 + [0.0]  # 23 = 8 + 8 + 7
    assert mask[1, 6:].sum() == 0 and mask[3, 0].sum() == 5


SCENARIO = ["federation.clients=4", "train.local_epochs=2", "data.partitioner=iid",
            "train.momentum=0.9", "train.batch_size=16"]


def _round(extra: list[str], vectorize: object) -> tuple[list[np.ndarray], Any]:
    config = load_scenario("default", [*SCENARIO, *extra])
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    spec = json.dumps(task.task_spec(), sort_keys=True)
    hook = cohort_hook(vectorize) if vectorize is not None else None  # None: no hook at all
    grid = InProcessGrid(client_app, 4, cohort_hook=hook)
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, spec, 0)})
    ids = grid.push_messages([Message(content, n, "train", group_id="1") for n in (1, 2, 3, 4)])
    deltas = []
    for reply in grid.pull_messages(ids):
        assert not reply.has_error(), reply.error
        update = decode_train_reply(reply, client_id="c", layout=layout, base_params=params,
                                    version=1)
        deltas.append(update.delta.copy())
    return deltas, hook


@pytest.mark.parametrize("extra", [[], ["train.optimizer=\"adam\"", "train.lr=0.01"],
                                   ["attack.fraction=0.5", "attack.kind=\"sign_flip\""]],
                         ids=["momentum", "adam", "attack"])
def test_vectorized_replies_match_sequential_ones(extra: list[str]) -> None:
    sequential, _ = _round(extra, None)
    vectorized, hook = _round(extra, True)
    assert hook.trained == 4
    for a, b in zip(sequential, vectorized, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert any(np.abs(a).max() > 0 for a in sequential)


def test_local_dp_noise_still_applies_per_client() -> None:
    extra = ["dp.mode=\"local\"", "dp.clip=0.5", "dp.noise_multiplier=1.0",
             "aggregation.weight_by=uniform"]
    noised, hook = _round(extra, True)
    assert hook.trained == 4
    plain, _ = _round([], True)
    for a, b in zip(plain, noised, strict=True):
        assert np.linalg.norm(b - a) > 0.1  # noise added after the batched training


def test_an_unsupported_cohort_falls_back_with_one_log_line(caplog) -> None:
    sequential, _ = _round(["train.proximal_mu=0.1"], None)
    with caplog.at_level(logging.INFO, logger="fedring"):
        fallback, hook = _round(["train.proximal_mu=0.1"], True)
        _, quiet = _round(["train.proximal_mu=0.1"], False)
    assert hook.trained == hook.back_to_back == quiet.back_to_back == 0
    lines = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
    assert len(lines) == 1 and "FedProx" in lines[0]  # none from `false`: nothing was asked
    for a, b in zip(sequential, fallback, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["auto", False])
def test_a_single_client_is_left_to_the_client_app(mode: object) -> None:
    hook = cohort_hook(mode)
    config = load_scenario("default", SCENARIO)
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    grid = InProcessGrid(client_app, 4, cohort_hook=hook)
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, json.dumps(task.task_spec(),
                                                                  sort_keys=True), 0)})
    [msg_id] = grid.push_messages([Message(content, 2, "train", group_id="1")])
    [reply] = grid.pull_messages([msg_id])
    assert not reply.has_error() and hook.trained == hook.back_to_back == 0


@pytest.mark.parametrize("value", ["\"yes\"", "1"])
def test_a_bad_vectorize_value_names_the_key(value: str) -> None:
    with pytest.raises(ValueError, match=r"engine\.vectorize"):
        load_scenario("default", [f"engine.vectorize={value}"])


def test_a_cohort_over_the_stack_budget_trains_batch_by_batch_as_replies_are_taken() -> None:
    from client.app import FedringClient
    from client.vectorized import CohortHook
    from simulations.apps import spec_from_run_config

    sequential, _ = _round([], None)
    config = load_scenario("default", SCENARIO)
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    hook = CohortHook(FedringClient(ScenarioTask, spec_from_run_config), True,
                             stack_budget=2 * 4 * layout.dim)  # two clients per batch
    grid = InProcessGrid(client_app, 4, cohort_hook=hook)
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, json.dumps(task.task_spec(),
                                                                  sort_keys=True), 0)})
    ids = grid.push_messages([Message(content, n, "train", group_id="1") for n in (1, 2, 3, 4)])
    trained = []
    for reply, expected in zip(grid.pull_messages(ids), sequential, strict=True):
        trained.append(hook.trained)
        delta = decode_train_reply(reply, client_id="c", layout=layout, base_params=params,
                                   version=1).delta
        np.testing.assert_allclose(delta, expected, rtol=1e-4, atol=1e-6)
    assert trained == [2, 2, 4, 4]


def test_auto_trains_a_cohort_too_large_for_one_batch_back_to_back(caplog) -> None:
    from client.app import FedringClient
    from client.vectorized import CohortHook
    from simulations.apps import spec_from_run_config

    config = load_scenario("default", SCENARIO)
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    hook = CohortHook(FedringClient(ScenarioTask, spec_from_run_config), "auto",
                             stack_budget=2 * 4 * layout.dim)
    grid = InProcessGrid(client_app, 4, cohort_hook=hook)
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, json.dumps(task.task_spec(),
                                                                  sort_keys=True), 0)})
    ids = grid.push_messages([Message(content, n, "train", group_id="1") for n in (1, 2, 3, 4)])
    with caplog.at_level(logging.INFO, logger="fedring"):
        replies = list(grid.pull_messages(ids))
    assert len(replies) == 4 and hook.trained == 0 and hook.back_to_back == 4
    assert any("do not fit one batch" in r.getMessage() for r in caplog.records)
    sequential, _ = _round([], None)
    for reply, expected in zip(replies, sequential, strict=True):
        np.testing.assert_array_equal(expected, decode_train_reply(
            reply, client_id="c", layout=layout, base_params=params, version=1).delta)


@pytest.mark.parametrize("extra", [[], ["train.optimizer=\"adam\"", "train.lr=0.01"],
                                   ["attack.fraction=0.5", "attack.kind=\"label_flip\""],
                                   ["dp.mode=\"local\"", "dp.clip=0.5", "dp.noise_multiplier=0",
                                    "aggregation.weight_by=uniform"]],
                         ids=["momentum", "adam", "label-flip", "local-dp-clip"])
def test_back_to_back_replies_are_the_client_apps_own_to_the_bit(extra: list[str]) -> None:
    one_by_one, _ = _round(extra, None)
    back_to_back, hook = _round(extra, False)
    assert hook.back_to_back == 4 and hook.trained == 0
    for a, b in zip(one_by_one, back_to_back, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len({a.tobytes() for a in one_by_one}) == 4  # four clients, four deltas


def test_a_large_model_is_not_trained_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import client.app

    monkeypatch.setattr(client.app, "IN_PLACE_MIN_DIM", 100)  # the test MLP: larger
    one_by_one, _ = _round([], None)
    replies, hook = _round([], False)
    assert hook.back_to_back == 0
    for a, b in zip(one_by_one, replies, strict=True):
        np.testing.assert_array_equal(a, b)


def _auto_round(extra: list[str], clients: int) -> tuple[list[np.ndarray], Any]:
    """One round of ``clients`` clients under ``engine.vectorize = "auto"``."""
    config = load_scenario("default", [*SCENARIO, *extra])
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    hook = cohort_hook("auto")
    grid = InProcessGrid(client_app, 4, cohort_hook=hook)
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, json.dumps(task.task_spec(),
                                                                  sort_keys=True), 0)})
    ids = grid.push_messages([Message(content, n, "train", group_id="1")
                              for n in range(1, clients + 1)])
    deltas = [decode_train_reply(r, client_id="c", layout=layout, base_params=params,
                                 version=1).delta.copy() for r in grid.pull_messages(ids)]
    return deltas, hook


def test_auto_trains_a_1m_parameter_cohort_one_by_one_and_says_why(caplog) -> None:
    from client.vectorized import AUTO_MAX_DIM, STACK_BUDGET

    big = ["model.hidden=[960, 960]"]  # 994,570 parameters: two clients fit one batch
    assert STACK_BUDGET // (4 * 994_570) >= 2 and AUTO_MAX_DIM < 994_570
    with caplog.at_level(logging.INFO, logger="fedring"):
        deltas, hook = _auto_round(big, 2)
    assert hook.trained == 0 and hook.back_to_back == 0  # the ClientApp trained each
    lines = [r.getMessage() for r in caplog.records if "not vectorized" in r.getMessage()]
    assert len(lines) == 1 and "994,570 parameters per client" in lines[0]
    config = load_scenario("default", [*SCENARIO, *big])
    task = ScenarioTask.from_config(config)
    params, layout = task.initial_params()
    grid = InProcessGrid(client_app, 4)  # no hook: each client trained as its message comes
    content = RecordDict({"arrays": model_record(layout, params),
                          "config": train_config(1, 1, json.dumps(task.task_spec(),
                                                                  sort_keys=True), 0)})
    ids = grid.push_messages([Message(content, n, "train", group_id="1") for n in (1, 2)])
    for reply, got in zip(grid.pull_messages(ids), deltas, strict=True):
        np.testing.assert_array_equal(got, decode_train_reply(
            reply, client_id="c", layout=layout, base_params=params, version=1).delta)


def test_auto_still_vectorizes_a_small_model_cohort(caplog) -> None:
    sequential, _ = _round([], None)
    with caplog.at_level(logging.INFO, logger="fedring"):
        vectorized, hook = _auto_round([], 4)
    assert hook.trained == 4 and hook.back_to_back == 0
    assert not any("not vectorized" in r.getMessage() for r in caplog.records)
    for a, b in zip(sequential, vectorized, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_a_large_hand_over_moves_the_processs_objects_out_of_the_collectors_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import client.vectorized

    monkeypatch.setattr(client.vectorized, "FREEZE_MIN_MESSAGES", 4)
    gc.unfreeze()
    try:
        _, hook = _auto_round([], 3)  # three messages: below the bound
        assert not hook.froze and gc.get_freeze_count() == 0
        frozen, hook = _auto_round([], 4)
        assert hook.froze and gc.get_freeze_count() > 0
        assert hook.trained == 4  # training goes on as before
    finally:
        gc.unfreeze()
    sequential, _ = _round([], None)
    for a, b in zip(sequential, frozen, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
