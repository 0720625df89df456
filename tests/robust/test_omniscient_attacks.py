"""ALIE and IPM: omniscient attackers forged from the round's honest updates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from aggregation.update import Update
from client.task import ATTACKER_METRIC
from simulations.attacks import alie, alie_z_max, ipm, omniscient_attack
from simulations.config import load_scenario

SMALL = ["federation.clients=10", "federation.rounds=2", "train.local_epochs=1",
         "data.partitioner=iid", "federation.checkpoint_every=0"]
HONEST = np.array([[1.0, 2.0], [3.0, 2.0], [5.0, 8.0]], dtype=np.float32)


def test_alie_z_max_is_baruch_et_al_formula():
    # n = 20, m = 4: s = floor(20 / 2 + 1) - 4 = 7 supporters; Phi(z) = (20 - 7) / 20
    assert alie_z_max(20, 4) == pytest.approx(norm.ppf(13 / 20), rel=1e-9)
    assert alie_z_max(20, 4) == pytest.approx(0.3853, abs=1e-4)
    # n = 50, m = 12 (the paper's CIFAR setting): s = 26 - 12 = 14, Phi(z) = 36 / 50
    assert alie_z_max(50, 12) == pytest.approx(norm.ppf(36 / 50), rel=1e-9)


def test_alie_is_mean_minus_z_std_per_coordinate():
    # column 1: 1, 3, 5 -> mean 3, sample variance (4 + 0 + 4) / 2 = 4
    # column 2: 2, 2, 8 -> mean 4, sample variance (4 + 4 + 16) / 2 = 12
    np.testing.assert_allclose(alie(HONEST, 1.0), [3 - 2, 4 - math.sqrt(12)], rtol=1e-6)
    np.testing.assert_allclose(alie(HONEST, 0.5), [3 - 1, 4 - 0.5 * math.sqrt(12)],
                               rtol=1e-6)
    np.testing.assert_allclose(alie(HONEST[:1], 1.0), [1.0, 2.0])  # one: no spread


def test_ipm_is_minus_epsilon_times_the_honest_mean():
    np.testing.assert_allclose(ipm(HONEST, 0.1), [-0.3, -0.4], rtol=1e-6)
    np.testing.assert_allclose(ipm(HONEST, 2.0), [-6.0, -8.0], rtol=1e-6)


def updates(bad: set[int], n: int = 5) -> list[Update]:
    rows = [np.array([float(i), 2.0 * i], dtype=np.float32) for i in range(n)]
    return [Update(str(i), rows[i], 10 + i, 0, {ATTACKER_METRIC: 1} if i in bad else {})
            for i in range(n)]


def hook(*overrides: str):
    config = load_scenario("default", [*SMALL, "attack.fraction=0.2", *overrides])
    return omniscient_attack(config)


def test_hook_replaces_only_the_attackers_with_the_forged_update():
    ups = updates({1, 3})
    out = hook("attack.kind=ipm", "attack.ipm_epsilon=0.5")(ups)
    honest = np.array([[0.0, 0.0], [2.0, 4.0], [4.0, 8.0]])
    for i in (0, 2, 4):
        assert out[i] is ups[i]
    for i in (1, 3):
        np.testing.assert_allclose(out[i].delta, -0.5 * honest.mean(axis=0), rtol=1e-6)
        assert (out[i].client_id, out[i].num_examples) == (ups[i].client_id, 10 + i)
        assert out[i].delta is not out[1 if i == 3 else 3].delta  # each its own copy
    out = hook("attack.kind=alie")(ups)
    z = norm.ppf((5 - (math.floor(5 / 2 + 1) - 2)) / 5)  # n = 5 updates, m = 2
    expected = honest.mean(axis=0) - z * honest.std(axis=0, ddof=1)
    np.testing.assert_allclose(out[1].delta, expected, rtol=1e-5)
    out = hook("attack.kind=alie", "attack.alie_z=2.0")(ups)
    np.testing.assert_allclose(out[3].delta, honest.mean(0) - 2 * honest.std(0, ddof=1),
                               rtol=1e-5)


def test_hook_is_installed_only_for_omniscient_attacks_and_leaves_honest_rounds():
    assert hook("attack.kind=sign_flip") is None
    assert omniscient_attack(load_scenario("default", SMALL)) is None
    ups = updates(set())
    assert hook("attack.kind=ipm")(ups) == ups  # no attacker in this round
    everyone = updates({0, 1, 2, 3, 4})
    assert hook("attack.kind=ipm")(everyone) == everyone  # no honest update to copy


@pytest.mark.parametrize(("overrides", "match"), [
    (["attack.kind=alie", "secagg.enabled=true"], "no one sees under secure aggregation"),
    (["attack.kind=ipm", "secagg.enabled=true"], "no one sees under secure aggregation"),
    (["attack.kind=ipm", "driver.kind=fedbuff", "driver.buffer_size=5"],
     "set driver.kind = 'sync'"),
    (["attack.kind=alie", "driver.late_policy=carry", "driver.deadline_s=1"],
     "driver.late_policy = 'drop'"),
    (["attack.kind=ipm", "attack.ipm_epsilon=0"], "attack.ipm_epsilon must be > 0"),
    (["attack.kind=alie", "attack.alie_z=-1"], "attack.alie_z must be >= 0"),
])
def test_where_the_attack_cannot_apply_fails_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, "attack.fraction=0.2", *overrides])


def test_ipm_run_sends_the_forged_updates(run_inprocess, store):
    """A real run: the attackers' accepted updates are -epsilon times the honest mean
    (recorded norms), and a large epsilon stops FedAvg from learning."""
    config = load_scenario("default", [*SMALL, "attack.fraction=0.2", "attack.kind=ipm",
                                       "attack.ipm_epsilon=8"])
    summary = run_inprocess(config)
    clean = run_inprocess(load_scenario("default", SMALL))
    rounds: dict[int, list] = {}
    for rnd, u in store.updates(summary["run_id"]):
        rounds.setdefault(rnd, []).append(u)
    for ups in rounds.values():
        bad = [u for u in ups if u.metrics.get(ATTACKER_METRIC)]
        assert len(bad) == 2 and all(u.fate == "accepted" for u in ups)
        assert bad[0].norm == pytest.approx(bad[1].norm, rel=1e-6)  # the same forged vector
    # 8 * the honest mean outweighs the honest sum of 8 updates: the model does not learn
    assert summary["final_accuracy"] < clean["final_accuracy"] - 0.2, (summary, clean)
