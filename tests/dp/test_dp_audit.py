"""The one-shot canary audit: the estimator (privacy.dp.audit), the canary stage in the
real pipeline (server.audit) and the [audit] section's checks."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from aggregation import Update
from privacy.dp import DPConfig
from privacy.dp.audit import (
    audit_epsilon,
    canary_entropy,
    cosines,
    estimate_epsilon,
    gaussian_mechanism_epsilon,
    random_canaries,
)
from server.audit import AuditConfig, CanaryAudit, sampling_rate
from server.config import AggregationConfig, FederationConfig
from server.dp import DPController
from server.rules import check_audit
from simulations.config import load_scenario

# ---- the Gaussian mechanism's epsilon(delta), against dp_accounting's PLD


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0, 2.5, 6.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-8])
def test_gaussian_mechanism_epsilon_matches_dp_accounting(mu, delta):
    # one Gaussian mechanism with sensitivity 1 and noise std 1/mu
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1.0 / mu))
    assert gaussian_mechanism_epsilon(mu, delta) == pytest.approx(acc.get_epsilon(delta),
                                                                  rel=1e-4, abs=1e-6)


def test_gaussian_mechanism_epsilon_is_zero_without_a_shift():
    assert gaussian_mechanism_epsilon(0.0, 1e-5) == 0.0
    assert gaussian_mechanism_epsilon(-2.0, 1e-5) == 0.0


# ---- canaries


def test_canaries_are_unit_directions_from_os_entropy():
    a, b = canary_entropy(), canary_entropy()
    assert a != b and a.bit_length() > 64
    rows = random_canaries(200, 3000, a)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(rows, random_canaries(200, 3000, a))  # resumable
    # independent uniform directions: pairwise cosines ~ N(0, 1/d)
    off = (rows @ rows.T)[np.triu_indices(200, 1)]
    assert abs(off.mean()) < 6 / math.sqrt(3000 * off.size)  # fresh entropy: 6 errors
    assert off.std() == pytest.approx(1 / math.sqrt(3000), rel=0.05)
    assert not np.allclose(rows, random_canaries(200, 3000, b))


# ---- the estimator on synthetic cosines with known Gaussians


@pytest.mark.parametrize("mu", [0.5, 2.0, 4.0])
def test_estimate_recovers_the_gaussian_mechanism_it_was_given(mu):
    rng = np.random.default_rng(7)
    s = 0.01
    seen = rng.normal(mu * s, s, 20_000)
    unseen = rng.normal(0.0, s, 20_000)
    est = estimate_epsilon(seen, unseen, 1e-5)
    assert est.mu == pytest.approx(mu, abs=5 * math.sqrt((1 + mu**2 / 2) / 20_000))
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1.0 / mu))
    assert est.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=0.05)


def test_estimate_takes_the_larger_spread_and_a_one_sided_shift():
    rng = np.random.default_rng(8)
    unseen = rng.normal(0.0, 1.0, 50_000)
    wide = estimate_epsilon(rng.normal(2.0, 2.0, 50_000), unseen, 1e-5)
    assert wide.mu == pytest.approx(1.0, abs=0.03)  # (2 - 0) / max(2, 1)
    # canaries pointing away from the model are no evidence of insertion
    assert estimate_epsilon(rng.normal(-3.0, 1.0, 1000), unseen, 1e-5).epsilon == 0.0


def test_audit_of_a_gaussian_mechanism_on_vectors():
    """One release of C * (sum of canaries) + N(0, sigma^2 I): mu = C / sigma, shrunk by the
    other canaries' share of the released vector's norm."""
    d, k, clip, sigma = 20_000, 400, 1.0, 1.0
    rows = random_canaries(k, d, canary_entropy())
    released = clip * rows.sum(axis=0) + np.random.default_rng().normal(0, sigma, d)
    est = audit_epsilon(released, rows, 1e-5)
    expected = clip / math.sqrt(sigma**2 + k * clip**2 / d)
    assert est.mu == pytest.approx(expected, abs=6 * math.sqrt((1 + expected**2 / 2) / k))
    assert est.null_std == pytest.approx(1 / math.sqrt(d), rel=0.25)
    assert cosines(np.zeros(d), rows).tolist() == [0.0] * k


def test_fresh_canaries_are_independent_across_blocks(monkeypatch):
    """The never-inserted canaries are drawn ``block`` rows at a time: every block from its
    own entropy, so the null fit rests on K distinct draws, none of them an inserted one."""
    import privacy.dp.audit as audit_module

    seen: dict[str, np.ndarray] = {}
    honest = audit_module.estimate_epsilon

    def spy(inserted, unseen, delta):
        seen["inserted"], seen["unseen"] = inserted, unseen
        return honest(inserted, unseen, delta)

    monkeypatch.setattr(audit_module, "estimate_epsilon", spy)
    d, k, entropy = 500, 200, canary_entropy()
    change = np.random.default_rng(5).normal(size=d)
    rows = random_canaries(k, d, entropy)
    audit_epsilon(change, rows, 1e-5, entropy=entropy, block=64)
    unseen = seen["unseen"]
    assert unseen.shape == (k,)
    assert np.unique(unseen).size == k  # no block repeats another
    assert not np.isin(unseen, seen["inserted"]).any()  # none is an inserted canary
    # K independent draws of ~ N(0, 1/d): their spread is the null's
    assert unseen.std() == pytest.approx(1 / math.sqrt(d), rel=0.2)


# ---- the canary stage in the real pipeline


def _central(z: float = 0.0, per_round: int = 4) -> DPController:
    return DPController(DPConfig.from_dict({"mode": "central", "clip": 1.0,
                                            "noise_multiplier": z}),
                        clients=10, clients_per_round=per_round, sampling="poisson")


def _updates(rng: np.random.Generator, d: int, n: int) -> list[Update]:
    return [Update(f"c{i}", (rng.normal(size=d) * 3).astype(np.float32), 10 + i, 0)
            for i in range(n)]


def test_central_dp_canaries_join_the_clipped_sum_and_not_the_count():
    """Canaries go into the clipped sum before the noise stage, which divides by the
    public count (4), never by the real (3) or real + canary (3 + 6) ones."""
    d, dp = 50, _central()
    audit = CanaryAudit(AuditConfig(canaries=6), rate=1.0, combine="mean", dp=dp)
    pipeline = AggregationConfig(weight_by="uniform").build(dp.stages(), canaries=audit)
    agg = pipeline.open_round(dim=d, version=0)
    updates = _updates(np.random.default_rng(1), d, 3)
    for u in updates:
        assert agg.submit(u).accepted
    delta = agg.finish()
    params = pipeline.apply(np.zeros(d, np.float32), delta, total_weight=agg.total_weight,
                            count=agg.num_accepted)
    assert agg.num_accepted == 3
    clipped = sum(u.delta / max(1.0, np.linalg.norm(u.delta)) for u in updates)
    expected = (clipped + 1.0 * audit.canaries.sum(axis=0)) / 4
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)
    assert audit.participations.tolist() == [1] * 6


def test_canaries_are_in_the_noised_sum_and_only_sampled_ones():
    dp = _central(z=0.0)
    audit = CanaryAudit(AuditConfig(canaries=400), rate=0.25, combine="mean", dp=dp)
    out = audit.apply(np.zeros(30, np.float32), 0.0, 0)
    taking_part = audit.participations == 1
    assert 60 < taking_part.sum() < 140  # about 100 of 400 at q = 0.25
    np.testing.assert_allclose(out, audit.canaries[taking_part].sum(axis=0), atol=1e-5)


def test_without_dp_a_canary_is_an_average_client_of_the_median_norm():
    d = 40
    audit = CanaryAudit(AuditConfig(canaries=3), rate=1.0, combine="mean")
    pipeline = AggregationConfig().build(canaries=audit)
    agg = pipeline.open_round(dim=d, version=0)
    updates = _updates(np.random.default_rng(2), d, 5)
    for u in updates:
        agg.submit(u)
    mean = agg.finish().copy()
    audit.observe_norms(v.norm for v in agg.verdicts if v.accepted)
    params = pipeline.apply(np.zeros(d, np.float32), mean, total_weight=agg.total_weight,
                            count=agg.num_accepted)
    median = np.median([np.linalg.norm(u.delta) for u in updates])
    np.testing.assert_allclose(params, mean + median * audit.canaries.sum(axis=0) / 5,
                               rtol=1e-5, atol=1e-6)


def test_distributed_dp_canaries_join_the_decoded_sum_over_the_public_count():
    dp = DPController(DPConfig.from_dict({"mode": "distributed", "clip": 2.0}),
                      clients=10, clients_per_round=5, sampling="poisson")
    audit = CanaryAudit(AuditConfig(canaries=4), rate=1.0, combine="mean", dp=dp)
    out = audit.apply(np.zeros(20, np.float32), 3.0, 3)
    np.testing.assert_allclose(out, 2.0 * audit.canaries.sum(axis=0) / 5, atol=1e-6)


def test_resumed_audit_keeps_its_canaries():
    audit = CanaryAudit(AuditConfig(canaries=5), rate=1.0, combine="sum")
    audit.apply(np.zeros(16, np.float32), 1.0, 1)
    again = CanaryAudit(AuditConfig(canaries=5), rate=1.0, combine="sum")
    again.load_state_dict(audit.state_dict())
    assert again.estimate(np.random.default_rng(3).normal(size=16)) is not None
    np.testing.assert_array_equal(again.canaries, audit.canaries)
    assert again.rounds == 1 and again.participations.tolist() == [1] * 5


# ---- [audit] in the scenario


def test_audit_is_off_by_default_and_in_the_resolved_config():
    cfg = load_scenario("default")
    assert cfg["audit"] == {"canaries": 0, "canary_norm": 0.0}
    assert check_audit(cfg) is None
    assert check_audit(load_scenario("default", ["audit.canaries=10"])).canaries == 10


@pytest.mark.parametrize("overrides, message", [
    (["audit.canaries=-1"], "audit.canaries must be 0"),
    (["audit.canaries=1"], "at least 2"),
    (["audit.canary_norm=-0.5"], "audit.canary_norm must be >= 0"),
    (["audit.canaries=true"], "audit.canaries must be int"),
    (["audit.rounds=3"], "audit.rounds"),
    (["audit.canaries=10", 'aggregation.combine="median"'], "aggregation.combine"),
    (["audit.canaries=10", 'driver.kind="fedbuff"'], "driver.kind"),
    (["audit.canaries=10", 'dp.mode="local"'], "dp.mode = 'local'"),
    (["audit.canaries=10", 'dp.mode="central"', 'aggregation.weight_by="uniform"',
      "audit.canary_norm=1.0"], "remove audit.canary_norm"),
    (["audit.canaries=10", "secagg.enabled=true"], "audit.canary_norm"),
])
def test_bad_audit_settings_fail_at_start_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_scenario("default", overrides)


def test_canary_sampling_rate_is_the_clients():
    assert sampling_rate(FederationConfig(clients=20, sample_fraction=0.25)) == 0.25
    assert sampling_rate(FederationConfig(clients=20, sample_fraction=0.3,
                                          sampling="poisson")) == 0.3
    assert sampling_rate(FederationConfig(clients=20)) == 1.0
