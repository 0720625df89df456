"""Distributed DP: plan, client encoding, modular sum, server decoding."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.linalg

from privacy.dp import (
    RandomizedHadamard,
    clip_l2,
    conditional_round,
    distributed_decode,
    distributed_encode,
    plan_distributed_dp,
    rounded_norm_bound,
    wrap_to_signed,
)
from privacy.dp.rotation import fwht_


def encode_round(deltas, plan, rng, seed):
    """Each client's int64 vector, and their exact (non-modular) sum."""
    encoded = [distributed_encode(d, plan, rng, seed)[0] for d in deltas]
    return encoded, np.sum(encoded, axis=0)


def _butterflies(x: np.ndarray) -> np.ndarray:
    """The textbook level-by-level transform, in numpy."""
    h = 1
    while h < x.size:
        y = x.reshape(-1, 2, h)
        top = y[:, 0, :].copy()
        y[:, 0, :] += y[:, 1, :]
        np.subtract(top, y[:, 1, :], out=y[:, 1, :])
        h *= 2
    return x


@pytest.mark.parametrize("n", [1, 2, 8, 4096, 8192, 1 << 16])
def test_hadamard_equals_the_level_by_level_transform_bit_for_bit(n):
    x = np.random.default_rng(n).standard_normal(n)
    np.testing.assert_array_equal(fwht_(x.copy()), _butterflies(x.copy()))
    np.testing.assert_allclose(fwht_(fwht_(x.copy())), n * x, rtol=1e-9, atol=1e-9)


def test_hadamard_refuses_what_it_cannot_transform():
    with pytest.raises(ValueError, match="power of two"):
        fwht_(np.zeros(12))
    with pytest.raises(ValueError, match="float64"):
        fwht_(np.zeros(16, np.float32))


def test_hadamard_matches_scipy_and_is_orthonormal():
    x = np.random.default_rng(0).standard_normal(64)
    np.testing.assert_allclose(fwht_(x.copy()), scipy.linalg.hadamard(64) @ x, atol=1e-12)
    rot = RandomizedHadamard(1000, seed=5)
    v = np.random.default_rng(1).standard_normal(1000)
    y = rot.forward(v)
    assert y.size == 1024
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(v))
    np.testing.assert_allclose(rot.inverse(y), v, atol=1e-12)
    # A spike is spread evenly over all coordinates.
    spike = RandomizedHadamard(1024, seed=5).forward(np.eye(1024)[3])
    np.testing.assert_allclose(np.abs(spike), 1 / 32)


def test_conditional_rounding_is_unbiased_and_within_the_bound():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(256)
    x *= 20.0 / np.linalg.norm(x)
    bound = rounded_norm_bound(20.0, 256, math.exp(-0.5))
    draws = np.array([conditional_round(x, bound, math.exp(-0.5), rng) for _ in range(400)])
    assert draws.dtype == np.int64
    assert np.all(np.abs(draws - x) < 1)
    assert np.all(np.linalg.norm(draws, axis=1) <= bound)
    # Rounding error mean is ~0 per coordinate (each is an average of 400 draws, |err| < 1).
    assert np.abs((draws - x).mean(axis=0)).max() < 0.15
    assert rounded_norm_bound(20.0, 256, 0.0) == pytest.approx(20.0 + 16.0)


def test_wrap_to_signed():
    v = wrap_to_signed(np.array([0, 1, 7, 8, 15, -1, -8, 16 + 3]), 4)
    np.testing.assert_array_equal(v, [0, 1, 7, -8, -1, -1, -8, 3])
    np.testing.assert_array_equal(wrap_to_signed(np.array([2**63 - 1], np.uint64), 8), [-1])


def test_plan_fields_are_consistent():
    plan = plan_distributed_dp(50, 3000, 0.7, 1.1, 18)
    assert plan.padded_dim == 4096
    assert plan.k_stddevs == pytest.approx(math.sqrt(2 * math.log(2 * 4096 / 1e-6)))
    # gamma is the largest scale whose sum std fits k stddevs in the modulus range.
    assert plan.k_stddevs * plan.sum_std == pytest.approx(2**17, rel=1e-6)
    assert plan.norm_bound == pytest.approx(
        rounded_norm_bound(plan.gamma * 0.7, 4096, math.exp(-0.5)))
    assert plan.norm_inflation == pytest.approx(plan.norm_bound / (plan.gamma * 0.7))
    assert plan.local_std == pytest.approx(1.1 * plan.norm_bound / math.sqrt(50))
    assert plan.sum_noise_std == pytest.approx(1.1 * 0.7 * plan.norm_inflation)
    assert plan.effective_noise_multiplier == pytest.approx(1.1, rel=1e-9)
    skellam = plan_distributed_dp(50, 3000, 0.7, 1.1, 18, "skellam")
    assert skellam.effective_noise_multiplier == pytest.approx(1.1)


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_decoded_sum_noise_matches_the_plan(mechanism):
    rng = np.random.default_rng(3)
    n, dim, clip = 8, 3000, 0.5
    plan = plan_distributed_dp(n, dim, clip, 1.0, 16, mechanism)
    residuals = []
    for seed in range(6):
        deltas = rng.standard_normal((n, dim)).astype(np.float32)
        _, total = encode_round(deltas, plan, rng, seed)
        decoded = distributed_decode(np.mod(total, 2**plan.bits), plan, seed)
        assert decoded.dtype == np.float32 and decoded.size == dim
        truth = np.sum([clip_l2(d, clip)[0] for d in deltas], axis=0, dtype=np.float64)
        residuals.append(decoded - truth)
    residuals = np.concatenate(residuals)  # 18000 values: std error ~ 0.5 %
    assert residuals.std() == pytest.approx(plan.sum_noise_std, rel=0.03)
    assert abs(residuals.mean()) < 4 * plan.sum_noise_std / math.sqrt(residuals.size)
    # The noise in the sum is that of the target central mechanism, up to rounding inflation.
    assert plan.sum_noise_std == pytest.approx(1.0 * clip, rel=0.01)


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_sum_never_wraps_with_aligned_worst_case_updates(mechanism):
    rng = np.random.default_rng(4)
    n, dim = 20, 256
    plan = plan_distributed_dp(n, dim, 1.0, 1.0, 12, mechanism)
    half = 2 ** (plan.bits - 1)
    peak = 0
    for seed in range(120):  # 120 x 256 coordinates of a 20-client sum
        spike = np.zeros(dim, np.float32)
        spike[seed % dim] = 10.0  # every client sends the same spike, clipped to norm 1
        encoded, total = encode_round([spike] * n, plan, rng, seed)
        assert np.all(total >= -half) and np.all(total < half)
        peak = max(peak, int(np.abs(total).max()))
        modular = np.mod(np.sum([np.mod(e, 2**plan.bits) for e in encoded], axis=0), 2**plan.bits)
        np.testing.assert_array_equal(wrap_to_signed(modular, plan.bits), total)
    assert peak > half / plan.k_stddevs  # the range is used, not wasted


def test_a_too_large_scale_does_wrap():
    """Control for the test above: the same check catches a plan that overflows."""
    rng = np.random.default_rng(4)
    plan = plan_distributed_dp(20, 256, 1.0, 1.0, 12)
    bad = dataclasses.replace(plan, gamma=plan.gamma * 4, norm_bound=plan.norm_bound * 4,
                              local_std=plan.local_std * 4)
    _, total = encode_round([np.ones(256, np.float32)] * 20, bad, rng, 0)
    assert np.any(np.abs(total) >= 2 ** (plan.bits - 1))


def test_plan_without_rotation_uses_worst_case_headroom():
    rng = np.random.default_rng(6)
    n, dim = 10, 64
    plan = plan_distributed_dp(n, dim, 1.0, 0.5, 20, rotate=False)
    assert plan.padded_dim == dim
    spike = np.zeros(dim, np.float32)
    spike[0] = 1.0
    _, total = encode_round([spike] * n, plan, rng, None)
    assert abs(total[0]) < 2 ** (plan.bits - 1)
    decoded = distributed_decode(total, plan)
    assert decoded[0] == pytest.approx(n, abs=6 * plan.sum_noise_std)


def test_plan_refuses_too_few_bits_and_names_the_fix():
    with pytest.raises(ValueError, match=r"raise bits to at least (\d+)") as info:
        plan_distributed_dp(100, 1_000_000, 1.0, 1.0, 12)
    needed = int(info.value.args[0].split("raise bits to at least ")[1].split(",")[0])
    plan_distributed_dp(100, 1_000_000, 1.0, 1.0, needed)  # the advice works
    with pytest.raises(ValueError, match="n_clients"):
        plan_distributed_dp(100, 1_000_000, 1.0, 1.0, needed - 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip": -1.0}, "clip"),
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"bits": 60}, "bits"),
        ({"mechanism": "gaussian"}, "mechanism"),
        ({"beta": 1.0}, "beta"),
        ({"n_clients": 0}, "n_clients"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, match):
    args = {"n_clients": 10, "dim": 100, "clip": 1.0, "noise_multiplier": 1.0, "bits": 20}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_distributed_dp(**args)


def test_encode_checks_dimension_and_seed():
    plan = plan_distributed_dp(10, 100, 1.0, 1.0, 20)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="dim=100"):
        distributed_encode(np.zeros(99, np.float32), plan, rng, 0)
    with pytest.raises(ValueError, match="rotation_seed"):
        distributed_encode(np.zeros(100, np.float32), plan, rng)
