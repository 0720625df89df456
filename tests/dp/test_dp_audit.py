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
from server.audit import CanaryAudit, sampling_rate
from server.config import AggregationConfig, AuditConfig, FederationConfig
from server.dp import DPController
from server.rounds import RoundResult, update_record
from server.scenario import ServerScenario
from server.settings_checks import check_audit
from server.store.records import UpdateRecord
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


# ---- the estimate's lower confidence bound, on draws with a known mu


def _exact_epsilon(mu: float, delta: float) -> float:
    """One Gaussian mechanism, sensitivity 1 and noise std 1/mu, under add/remove-one."""
    acc = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1.0 / mu))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("mu", [0.5, 1.5, 3.0])
def test_lower_bound_stays_below_the_exact_epsilon_in_95_percent_of_trials(mu):
    """300 audits of K = 100 canaries whose cosines are the Gaussian mechanism's with a
    known mu: the 95% lower bound exceeds the exact epsilon in at most 5% of them, sits
    about 1.645 standard deviations of the estimate below it (not vacuous), and the
    estimate itself lands above the exact figure in a good share of correct runs."""
    rng = np.random.default_rng(int(mu * 10))
    k, trials, s, delta = 100, 300, 0.01, 1e-5
    exact = _exact_epsilon(mu, delta)
    ests = [estimate_epsilon(rng.normal(mu * s, s, k), rng.normal(0.0, s, k), delta)
            for _ in range(trials)]
    lower = np.array([e.epsilon_lower for e in ests])
    point = np.array([e.epsilon for e in ests])
    mus = np.array([e.mu for e in ests])
    assert (lower > exact).sum() <= 0.05 * trials
    gap = np.median(mus - np.array([e.mu_lower for e in ests]))
    assert gap == pytest.approx(1.645 * mus.std(), rel=0.25)
    assert 0.2 * trials <= (point > exact).sum() <= 0.6 * trials
    assert all(e.mu_lower <= e.mu and e.epsilon_lower <= e.epsilon for e in ests)


def test_lower_bound_is_a_function_of_the_cosines():
    rng = np.random.default_rng(11)
    seen, unseen = rng.normal(0.02, 0.01, 150), rng.normal(0.0, 0.01, 150)
    a, b = estimate_epsilon(seen, unseen, 1e-5), estimate_epsilon(seen.copy(), unseen, 1e-5)
    assert a.mu_lower == b.mu_lower and 0 < a.mu_lower < a.mu
    assert a.epsilon_lower == pytest.approx(gaussian_mechanism_epsilon(a.mu_lower, 1e-5))
    assert a.confidence == 0.95
    assert estimate_epsilon(seen, unseen, 1e-5, confidence=0.99).mu_lower < a.mu_lower


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


def _result(records: list[UpdateRecord], noise_multiplier: float | None = None) -> RoundResult:
    return RoundResult(aggregate=None, status="completed", records=records,
                       num_sampled=len(records), num_replies=len(records),
                       noise_multiplier=noise_multiplier)


def test_without_dp_a_canary_is_an_average_client_of_the_median_norm():
    """Sized from the round's accepted updates only: an update the norm bound rejected
    (an attacker's 1e6) never moves the canaries' norm."""
    d = 40
    audit = CanaryAudit(AuditConfig(canaries=3), rate=1.0, combine="mean")
    pipeline = AggregationConfig(max_norm=100.0).build(canaries=audit)
    agg = pipeline.open_round(dim=d, version=0)
    updates = _updates(np.random.default_rng(2), d, 5)
    for u in updates:
        assert agg.submit(u).accepted
    huge = Update("attacker", np.full(d, 1e6, np.float32), 10, 0)
    assert not agg.submit(huge).accepted
    mean = agg.finish().copy()
    audit.observe_round(_result([update_record(v) for v in agg.verdicts]))
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


# ---- the reference: the exact epsilon of what a canary went through


def _pld(rounds: list[tuple[float, float, int]], delta: float = 1e-5) -> float:
    """dp_accounting's PLD under add/remove-one of runs of (q, z, n): each round one
    Poisson(q) sampled Gaussian of multiplier z (a plain Gaussian at q = 1)."""
    acc = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for q, z, n in rounds:
        event = dp_accounting.GaussianDpEvent(z)
        acc.compose(event if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, event), n)
    return acc.get_epsilon(delta)


def test_reference_is_the_pld_epsilon_of_sampled_canary_rounds():
    dp = DPController(DPConfig.from_dict({"mode": "central", "clip": 1.0,
                                          "noise_multiplier": 1.3}),
                      clients=10, clients_per_round=3, sampling="poisson")
    audit = CanaryAudit(AuditConfig(canaries=4), rate=0.3, combine="mean", dp=dp)
    assert audit.reference() == 0.0
    for _ in range(5):
        audit.apply(np.zeros(20, np.float32), 0.0, 0)
    assert audit.reference() == pytest.approx(_pld([(0.3, 1.3, 5)]), rel=1e-6)
    assert audit.summary(np.ones(20))["audit_relation"] == "add/remove-one"


def test_reference_of_adaptive_clipping_is_the_noise_on_the_clipped_sum():
    """Adaptive clipping spends part of z on the count; a canary (never counted) meets
    only the update noise, z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et al. 2021)."""
    dp = DPController(DPConfig.from_dict({"mode": "central", "clip": "adaptive",
                                          "noise_multiplier": 1.0,
                                          "clipped_count_stddev": 2.0}),
                      clients=10, clients_per_round=10, sampling="fixed")
    audit = CanaryAudit(AuditConfig(canaries=4), rate=1.0, combine="mean", dp=dp)
    for _ in range(3):
        audit.apply(np.zeros(20, np.float32), 0.0, 0)
    z_delta = (1.0 ** -2 - (2 * 2.0) ** -2) ** -0.5
    assert audit.reference() == pytest.approx(_pld([(1.0, z_delta, 3)]), rel=1e-6)


def test_reference_charges_each_round_its_multiplier_and_survives_a_resume():
    """Distributed DP: a round with dropouts holds less noise (its charged multiplier is
    what the round source reports); a resumed audit keeps every round's multiplier."""
    dp = DPController(DPConfig.from_dict({"mode": "distributed", "clip": 1.0,
                                          "noise_multiplier": 2.0}),
                      clients=10, clients_per_round=5, sampling="poisson")
    plan = dp.plan_distributed(dim=20, bits=32, max_clients=10)
    full, dropped = dp.round_noise_multiplier, plan.noise_multiplier_with(7)
    assert dropped < full
    audit = CanaryAudit(AuditConfig(canaries=4), rate=0.5, combine="mean", dp=dp)
    audit.observe_round(_result([]))
    audit.apply(np.zeros(20, np.float32), 0.0, 0)
    audit.observe_round(_result([], noise_multiplier=dropped))
    audit.apply(np.zeros(20, np.float32), 0.0, 0)
    audit.apply(np.zeros(20, np.float32), 0.0, 0)  # no report: a full round
    expected = _pld([(0.5, full, 1), (0.5, dropped, 1), (0.5, full, 1)])
    assert audit.reference() == pytest.approx(expected, rel=1e-6)
    again = CanaryAudit(AuditConfig(canaries=4), rate=0.5, combine="mean", dp=dp)
    again.load_state_dict(audit.state_dict())
    assert again.reference() == pytest.approx(expected, rel=1e-6)
    older = {k: v for k, v in audit.state_dict().items() if k != "accountant"}
    again.load_state_dict(older)  # saved before multipliers were kept: full rounds
    assert again.reference() == pytest.approx(_pld([(0.5, full, 3)]), rel=1e-6)


def _released(audit: CanaryAudit, rounds: int, sigma: float, seed: int) -> np.ndarray:
    """theta_T - theta_0 of rounds in which only the canaries take part and the clipped
    sum gets N(0, sigma^2) per coordinate."""
    rng = np.random.default_rng(seed)
    change = np.zeros(4000, np.float32)
    for _ in range(rounds):
        change += audit.apply(np.zeros(4000, np.float32), 0.0, 0)
        change += rng.normal(0.0, sigma, 4000).astype(np.float32)
    return change


@pytest.mark.parametrize("sigma, flagged", [(2.0, False), (1.0, True)])
def test_a_run_is_flagged_only_when_the_lower_bound_exceeds_the_reference(
        sigma, flagged, monkeypatch):
    """Central DP at z = 2, every canary in every round: noise of std 2C is a correct run
    (not flagged), half of it is a bug (flagged, with a warning line)."""
    import privacy.dp.audit as audit_module

    monkeypatch.setattr(audit_module, "canary_entropy", lambda: 1234)  # the fresh canaries
    audit = CanaryAudit(AuditConfig(canaries=200), rate=1.0, combine="mean",
                        dp=_central(z=2.0, per_round=1))
    audit.entropy, audit.rng = 99, np.random.default_rng(5)
    summary = audit.summary(_released(audit, 10, sigma, seed=6))
    assert summary["epsilon_audit_reference"] == pytest.approx(_pld([(1.0, 2.0, 10)]))
    assert summary["epsilon_audit_lower"] <= summary["epsilon_audit"]
    assert summary["audit_flag"] is flagged
    assert (summary["epsilon_audit_lower"] > summary["epsilon_audit_reference"]) is flagged
    warning = CanaryAudit.warning(summary)
    assert (warning is not None) is flagged
    if flagged:
        assert "epsilon_audit_lower" in warning and "add/remove-one" in warning


def test_without_dp_there_is_no_reference_and_no_flag():
    audit = CanaryAudit(AuditConfig(canaries=20, canary_norm=1.0), rate=1.0, combine="sum")
    audit.apply(np.zeros(500, np.float32), 1.0, 1)
    summary = audit.summary(np.random.default_rng(4).normal(size=500))
    assert summary["epsilon_audit_reference"] is None and summary["audit_flag"] is None
    assert summary["epsilon_audit_lower"] <= summary["epsilon_audit"]
    assert CanaryAudit.warning(summary) is None and "accountant" not in audit.state_dict()


# ---- [audit] in the scenario


def test_audit_is_off_by_default_and_in_the_resolved_config():
    cfg = load_scenario("default")
    assert cfg["audit"] == {"canaries": 0, "canary_norm": 0.0}
    assert check_audit(ServerScenario.of(cfg)) is None
    audited = ServerScenario.of(load_scenario("default", ["audit.canaries=10"]))
    assert check_audit(audited).canaries == 10


@pytest.mark.parametrize("overrides, message", [
    (["audit.canaries=-1"], "audit.canaries must be 0"),
    (["audit.canaries=1"], "at least 2"),
    (["audit.canary_norm=-0.5"], "audit.canary_norm must be >= 0"),
    (["audit.canaries=true"], "audit.canaries must be int"),
    (["audit.rounds=3"], "audit.rounds"),
    (["audit.canaries=10", 'aggregation.combine="median"'], "aggregation.combine"),
    (["audit.canaries=10", 'driver.kind="fedbuff"'], "driver.kind"),
    (["audit.canaries=10", 'dp.mode="local"', 'aggregation.weight_by="uniform"'],
     "dp.mode = 'local'"),
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
