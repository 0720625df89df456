"""Simulated attacks (``[attack]``): transforms, attacker choice, the ClientApp hook, a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.updates import model_record, read_delta, read_model
from client.task import ATTACKER_METRIC
from simulations.apps import client_app
from simulations.attacks import (
    Attack,
    AttackConfig,
    choose_attackers,
    flip_labels,
    gaussian_noise,
    scale,
    sign_flip,
)
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask, task_spec

SMALL = ["federation.clients=10", "federation.rounds=2", "train.local_epochs=1",
         "data.partitioner=iid", "federation.checkpoint_every=0"]


def attack_config(*overrides: str) -> dict:
    return load_scenario("default", [*SMALL, "attack.fraction=0.2", *overrides])


@pytest.fixture
def one_torch_thread():
    """Training runs on one thread: on a loaded 2-core machine two threads fight."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the transforms against their definitions ---------------------------------------------
def test_sign_flip_and_scale_follow_their_definition():
    delta = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    np.testing.assert_array_equal(sign_flip(delta.copy()), -delta)
    np.testing.assert_array_equal(sign_flip(delta.copy(), 2.5), np.float32(-2.5) * delta)
    np.testing.assert_array_equal(scale(delta.copy(), 10.0), np.float32(10.0) * delta)
    out = delta.copy()
    assert scale(out, 3.0) is out  # in place: the reply buffer is reused


def test_gaussian_noise_replaces_or_adds_n_0_std2():
    delta = np.full(200_000, 5.0, dtype=np.float32)
    replaced = gaussian_noise(delta.copy(), 0.3, np.random.default_rng(1))
    expected = np.random.default_rng(1).normal(0.0, 0.3, size=delta.shape).astype(np.float32)
    np.testing.assert_array_equal(replaced, expected)  # the delta is gone
    assert abs(replaced.mean()) < 0.01 and replaced.std() == pytest.approx(0.3, rel=0.01)
    added = gaussian_noise(delta.copy(), 0.3, np.random.default_rng(1), mode="add")
    np.testing.assert_array_equal(added, delta + expected)
    with pytest.raises(ValueError, match="noise mode"):
        gaussian_noise(delta.copy(), 0.3, np.random.default_rng(1), mode="swap")


def test_label_maps_are_the_documented_permutations():
    y = torch.arange(10).repeat(3)
    assert torch.equal(flip_labels(y, 10), 9 - y)
    assert torch.equal(flip_labels(y, 10, "shift"), (y + 1) % 10)
    for label_map in ("reverse", "shift"):  # permutations: every class still appears once
        assert sorted(flip_labels(torch.arange(10), 10, label_map).tolist()) == list(range(10))
        assert not torch.equal(flip_labels(y, 10, label_map), y)


def test_tamper_changes_attackers_only():
    delta = np.random.default_rng(2).normal(size=100).astype(np.float32)
    for kind, expected in (("sign_flip", -delta), ("scale", np.float32(10.0) * delta),
                           ("label_flip", delta)):
        attack = Attack(AttackConfig(fraction=0.3, kind=kind), seed=4, clients=10)
        assert len(attack.attackers) == 3
        for pid in range(10):
            out = delta.copy()
            assert attack.tamper(pid, out, seed=7) is attack.is_attacker(pid)
            np.testing.assert_array_equal(out, expected if attack.is_attacker(pid) else delta)
    noise = Attack(AttackConfig(fraction=0.3, kind="gaussian_noise", noise_std=2.0),
                   seed=4, clients=10)
    pid = min(noise.attackers)
    a, b, c = delta.copy(), delta.copy(), delta.copy()
    noise.tamper(pid, a, seed=7), noise.tamper(pid, b, seed=7), noise.tamper(pid, c, seed=8)
    np.testing.assert_array_equal(a, b)  # reproducible from the training seed
    assert not np.array_equal(a, c) and not np.array_equal(a, delta)


# -- who attacks ---------------------------------------------------------------------------
def test_attackers_are_deterministic_and_respect_fraction():
    for clients in (5, 10, 20, 37):
        for fraction in (0.0, 0.1, 0.2, 0.5, 1.0):
            chosen = choose_attackers(fraction, clients, seed=3)
            assert chosen == choose_attackers(fraction, clients, seed=3)
            assert len(chosen) == int(fraction * clients + 0.5)  # halves round up
            assert len(set(chosen)) == len(chosen) and all(0 <= p < clients for p in chosen)
    assert choose_attackers(1.0, 10, seed=0) == tuple(range(10))
    draws = {choose_attackers(0.2, 20, seed=s) for s in range(10)}
    assert len(draws) > 5  # the seed picks them, not the partition order


def test_label_flip_flips_the_attackers_labels_only():
    config = attack_config("attack.kind=label_flip")
    honest, attacked = ScenarioTask.from_config(load_scenario("default", SMALL)), \
        ScenarioTask.from_config(config)
    attackers = set(choose_attackers(0.2, 10, seed=config["seed"]))
    assert attacked.attack is not None and attacked.attack.attackers == attackers
    for pid in range(10):
        (x0, y0), (x1, y1) = honest.partition(pid), attacked.partition(pid)
        assert torch.equal(x0, x1)
        assert torch.equal(y1, 9 - y0 if pid in attackers else y0), pid
    # the shared dataset is untouched: a later honest task still sees the true labels
    train_idx, _ = honest.split_indices(min(attackers))  # the partition less its held-out split
    y_true = torch.from_numpy(honest.dataset.y_train[train_idx])
    assert torch.equal(honest.partition(min(attackers))[1], y_true)


# -- through the ClientApp ----------------------------------------------------------------
def train_reply(spec: dict, partition_id: int, *, delta: bool) -> tuple[Message, np.ndarray]:
    """One real train message to the ClientApp; the reply and the global model it got."""
    task = ScenarioTask(spec)
    params, layout = task.initial_params()
    config = {"server-round": 1, ConfigKey.TASK: json.dumps(spec, sort_keys=True)}
    if delta:
        config.update({ConfigKey.REPLY: "delta", ConfigKey.VERSION: 0})
    grid = InProcessGrid(client_app, spec["clients"])
    msg = grid.create_message(RecordDict({"arrays": model_record(layout, params),
                                          "config": ConfigRecord(config)}),
                              "train", partition_id + 1, group_id="1")
    [reply] = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error
    return reply, params


def test_client_app_sends_the_attackers_scaled_delta(one_torch_thread):
    config = attack_config("attack.kind=scale", "attack.scale=10.0")
    spec, honest_spec = task_spec(config), task_spec(load_scenario("default", SMALL))
    assert "attack" in spec and "attack" not in honest_spec
    attacker = min(choose_attackers(0.2, 10, seed=config["seed"]))
    honest, _ = train_reply(honest_spec, attacker, delta=True)
    poisoned, _ = train_reply(spec, attacker, delta=True)
    d_honest = read_delta(honest.content["delta"])
    np.testing.assert_array_equal(read_delta(poisoned.content["delta"]),
                                  np.float32(10.0) * d_honest)
    assert poisoned.content["metrics"][ATTACKER_METRIC] == 1
    assert ATTACKER_METRIC not in honest.content["metrics"]
    # under a stock Flower strategy the full weights carry the poisoned delta too
    full, base = train_reply(spec, attacker, delta=False)
    task = ScenarioTask(spec)
    _, layout = task.initial_params()
    weights = read_model(full.content["arrays"], layout, out=np.empty(layout.dim, np.float32))
    np.testing.assert_allclose(weights - base, 10.0 * d_honest, atol=1e-5)


# -- a run: FedAvg collapses under a scale attack, the median holds -----------------------
def test_scale_attack_breaks_fedavg_not_median(run_inprocess, store, one_torch_thread):
    overrides = ["federation.rounds=4", "attack.kind=scale", "attack.scale=100.0"]
    results = {}
    for combine in ("mean", "median"):
        summary = run_inprocess(attack_config(*overrides, f"aggregation.combine={combine}"))
        results[combine] = summary["final_accuracy"]
        flagged = {int(u.metrics[MetricKey.PARTITION]) for _, u in
                   store.updates(summary["run_id"]) if u.metrics.get(ATTACKER_METRIC) == 1}
        assert flagged == set(choose_attackers(0.2, 10, seed=0))  # recorded per update
    # seed 0: FedAvg 0.10 (chance), median 0.80; without attackers both reach 0.80
    assert results["median"] > 0.6 and results["mean"] < 0.25, results


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("attack.fraction=1.5", "attack.fraction must be in \\[0, 1\\]"),
    ("attack.fraction=-0.1", "attack.fraction must be in \\[0, 1\\]"),
    ("attack.kind=backdoor", "attack.kind 'backdoor' is unknown"),
    ("attack.noise_mode=swap", "attack.noise_mode 'swap' is unknown"),
    ("attack.label_map=random", "attack.label_map 'random' is unknown"),
    ("attack.factor=0", "attack.factor must be > 0"),
    ("attack.noise_std=-1", "attack.noise_std must be >= 0"),
    ('attack.fraction="lots"', "attack.fraction must be float"),
    ("attack.target=3", "unknown key\\(s\\) attack.target"),
    ("attack.fraction=0.04", "selects no attacker"),
])
def test_bad_attack_settings_fail_at_start(override, message):
    with pytest.raises(ValueError, match=message):
        load_scenario("default", [*SMALL, override])


def test_attack_defaults_to_none_and_works_with_secure_aggregation():
    assert load_scenario("default", SMALL)["attack"]["fraction"] == 0.0
    assert "attack" not in task_spec(load_scenario("default", SMALL))
    # secure aggregation cannot see who attacks: the combination is allowed (and linear)
    config = attack_config("secagg.enabled=true", "attack.kind=sign_flip")
    assert config["attack"]["kind"] == "sign_flip" and config["secagg"]["enabled"] is True


def test_summary_names_the_attackers_only_when_attacking():
    from simulations.cli import _attackers

    config = attack_config()
    expected = sorted(choose_attackers(0.2, 10, config["seed"]))
    assert _attackers(config) == expected and len(expected) == 2
    assert _attackers(load_scenario("default", SMALL)) is None
