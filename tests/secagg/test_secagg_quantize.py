"""Fixed-point quantization and the headroom check."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from privacy.secagg import (
    Status,
    check_headroom,
    dequantize,
    dequantize_weighted,
    max_scale,
    quantize,
    quantize_weighted,
    run_secagg_round,
)
from privacy.secagg.quantize import error_bound, max_level


def test_headroom_passes_a_fitting_config_and_returns_the_worst_sum():
    # L = ceil(2 * 2 * 1 * 2^10) = 4096 per client; 1000 clients: 4,096,000 < 2^22
    assert check_headroom(1000, 22, 1.0, 2.0, scale=2.0**10) == 4_096_000


def test_headroom_raises_and_names_every_fix():
    with pytest.raises(ValueError) as err:
        check_headroom(1100, 22, 1.0, 2.0, scale=2.0**10)  # 4,505,600 >= 2^22
    text = str(err.value)
    assert "raise bits to >= 23" in text
    assert "lower n to <= 1023" in text  # 1023 * 4096 < 2^22 <= 1024 * 4096
    assert "lower clip_range to <= 0.930908" in text  # 3813 per client / (2*2*1024)
    with pytest.raises(ValueError, match=r"66 bits needed \(> 64\).*weight coordinate alone"):
        check_headroom(2**40, 64, 1.0, 1.0, scale=2.0**24)


def test_suggested_fixes_really_fit():
    n, bits, clip, w, scale = 1100, 22, 1.0, 2.0, 2.0**10
    check_headroom(n, 23, clip, w, scale=scale)
    check_headroom(1023, bits, clip, w, scale=scale)
    check_headroom(n, bits, 0.930908, w, scale=scale)
    for too_much in ({"n": 1024}, {"clip_range": 0.931}):
        args = {"n": n, "bits": bits, "clip_range": clip, "max_weight": w} | too_much
        with pytest.raises(ValueError):
            check_headroom(**args, scale=scale)


def test_max_scale_is_the_largest_fitting_power_of_two():
    s = max_scale(100, 32, 1.0, 4.0)
    check_headroom(100, 32, 1.0, 4.0, scale=s)
    with pytest.raises(ValueError):
        check_headroom(100, 32, 1.0, 4.0, scale=2 * s)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_sum_at_the_boundary_does_not_wrap(rounding):
    """n inputs all at the top level sum to exactly the largest value that fits."""
    clip, w, scale = 1.0, 1.0, 3.0  # L = 6
    bits = 5  # 2^5 - 1 = 31 = 5 * 6 + 1: five clients fit, six do not
    n = 5
    assert check_headroom(n, bits, clip, w, scale=scale) == 30
    with pytest.raises(ValueError):
        check_headroom(n + 1, bits, clip, w, scale=scale)
    rng = np.random.default_rng(0)
    big = np.full(8, 5.0)  # clipped to +clip: every coordinate at the top level
    q = [
        quantize_weighted(
            big,
            w,
            bits=bits,
            clip_range=clip,
            scale=scale,
            max_weight=w,
            rounding=rounding,
            rng=rng,
        )
        for _ in range(n)
    ]
    assert all(int(v.max()) == max_level(clip, scale, w) for v in q)
    total, server = run_secagg_round(q, k=n - 1, t=3, bits=bits)
    assert server.status is Status.COMPLETED
    assert total[:-1].tolist() == [30] * 8  # no wrap: the true integer sum
    sum_wx, sum_w = dequantize_weighted(total, n, clip_range=clip, scale=scale, max_weight=w)
    np.testing.assert_allclose(sum_wx, n * clip * w)
    assert sum_w == pytest.approx(n * w)
    # one more client at the top would wrap mod 2^5: the check above is what prevents it
    q.append(q[0])
    total, _ = run_secagg_round(q, k=n, t=4, bits=bits)
    assert total[:-1].tolist() == [(36) % 32] * 8


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_quantize_round_trip_within_bound(rounding):
    rng = np.random.default_rng(1)
    clip, scale, n = 2.0, 2.0**12, 7
    xs = [rng.uniform(-3, 3, 5000) for _ in range(n)]
    total = sum(
        quantize(x, bits=32, clip_range=clip, scale=scale, rounding=rounding, rng=rng).astype(
            np.uint64
        )
        for x in xs
    )
    exact = sum(np.clip(x, -clip, clip) for x in xs)
    err = np.abs(dequantize(total, n, clip_range=clip, scale=scale) - exact)
    assert err.max() <= error_bound(n, scale, rounding)
    if rounding == "stochastic":
        assert abs(err.mean()) < error_bound(n, scale)  # sanity
        signed = dequantize(total, n, clip_range=clip, scale=scale) - exact
        assert abs(signed.mean()) < 3 * np.sqrt(n) / scale / np.sqrt(5000)  # unbiased


def test_quantize_validation():
    kw = dict(bits=32, clip_range=1.0, scale=10.0, max_weight=2.0)
    with pytest.raises(ValueError, match="weight must be in"):
        quantize_weighted(np.zeros(3), 2.5, **kw)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weighted(np.array([np.nan]), 1.0, **kw)
    with pytest.raises(ValueError, match="rounding"):
        quantize(np.zeros(3), bits=8, clip_range=1.0, scale=1.0, rounding="up")
    q = quantize_weighted(np.array([-1.0, 0.0, 1.0]), 2.0, **kw)
    assert q.dtype == np.uint32 and q.tolist() == [0, 20, 40, 20]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
@pytest.mark.parametrize(("rounding", "threads"), [("nearest", 1), ("stochastic", 1),
                                                   ("stochastic", 3)])
def test_the_encoding_pass_counts_what_it_clips(dtype, rounding, threads, monkeypatch):
    """quantize_counting_into writes quantize_weighted_into's words and counts the clipped
    coordinates as a float64 comparison does (values at the clip range are not clipped), on
    one thread or several."""
    from privacy.secagg.quantize import (
        CHUNK,
        PARALLEL_COORDS,
        quantize_counting_into,
        quantize_weighted_into,
    )
    from tests.shared_chunks import every_thread_works

    clip = 0.75 if dtype is not np.int32 else 3.0
    d = PARALLEL_COORDS + 2 * CHUNK + 5
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(d) * (0.6 if dtype is not np.int32 else 3.0)).astype(dtype)
    x[:4] = [clip, -clip, np.nextafter(clip, 2), -np.nextafter(clip, 2)] if dtype is not np.int32 \
        else [3, -3, 4, -4]
    kw = {"clip_range": clip, "scale": 2.0**16, "max_weight": 4.0, "rounding": rounding,
          "threads": threads}
    want = quantize_weighted_into(x, 3.0, rng=np.random.default_rng(2),
                                  out=np.empty(d + 1, np.uint32), **kw)
    seen = every_thread_works(monkeypatch)
    got = np.empty(d + 1, np.uint32)
    clipped = quantize_counting_into(x, 3.0, rng=np.random.default_rng(2), out=got, **kw)
    np.testing.assert_array_equal(got, want)
    assert clipped == np.count_nonzero(np.abs(x.astype(np.float64)) > clip) > 2
    assert seen["shared"] == (threads > 1)


def test_the_counting_pass_still_refuses_a_non_finite_update():
    from privacy.secagg.quantize import quantize_counting_into

    x = np.zeros(10, np.float32)
    x[7] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        quantize_counting_into(x, 1.0, clip_range=1.0, scale=2.0**10,
                               out=np.empty(11, np.uint32))
    assert quantize_counting_into(x[:5] + 3, 1.0, clip_range=1.0, scale=2.0**10,
                                  out=np.empty(6, np.uint32)) == 5


def test_a_thread_s_chunks_out_of_order_take_their_own_noise():
    """Stochastic rounding: a thread that jumps to another thread's rest starts the noise
    stream at that chunk's block, so any order of chunks gives the same words."""
    q = importlib.import_module("privacy.secagg.quantize")  # the package's quantize: a function
    d = 3 * q.CHUNK + 10
    x = (np.random.default_rng(4).standard_normal(d) * 0.3).astype(np.float32)
    kw = {"clip_range": 1.0, "scale": 2.0**20, "max_weight": 1.0}
    want = q.quantize_weighted_into(x, 1.0, rng=np.random.default_rng(5),
                                    out=np.empty(d + 1, np.uint32), **kw)
    got = np.empty(d + 1, np.uint32)
    key = np.random.default_rng(5).bytes(16)  # the noise key quantize draws first
    args = (2.0**20, 2.0**20, 1.0, float(q.max_level(1.0, 2.0**20, 1.0)))
    order = [(2 * q.CHUNK, 3 * q.CHUNK), (0, q.CHUNK), (3 * q.CHUNK, d), (q.CHUNK, 2 * q.CHUNK)]
    assert q._encode_chunks(x, got, args, key, False, iter(order)) == 0
    np.testing.assert_array_equal(got[:d], want[:d])
