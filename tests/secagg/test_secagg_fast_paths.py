"""The fast paths agree with their references: compiled quantization (one pass; stochastic
noise from AES-CTR, chunk by chunk), masking into narrow words with the first vector and
mask added in one pass, and reused buffers that are never handed out while referenced."""

from __future__ import annotations

import gc
import itertools
import os

import numpy as np
import pytest

from client.secure_client import quantize_into
from privacy.secagg import Stage, quantize_weighted, run_secagg_round
from privacy.secagg.buffers import BufferPool
from privacy.secagg.messages import MsgType, decode_shares_and_input, read_header
from privacy.secagg.params import word_dtype
from privacy.secagg.prg import CHUNK_BYTES, PARALLEL_WORDS, combine, expand
from privacy.secagg.quantize import (
    CHUNK,
    PARALLEL_COORDS,
    max_level,
    quantize_weighted_into,
)
from privacy.secagg.workers import spans as work_spans
from privacy.secagg.workers import worker_cpu_seconds
from tests.shared_chunks import every_thread_works

D = 3 * CHUNK + 17  # chunks, the last one partial


def _update(seed: int, spread: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(D) * spread).astype(np.float32)


# --- quantization ------------------------------------------------------------------------

@pytest.mark.parametrize(("clip", "scale", "max_weight", "weight", "dtype", "spread"), [
    (1.0, 2.0**16, 50.0, 37.0, np.uint32, 0.3),  # integral offset: one add, nothing clipped
    (1.0, 2.0**16, 50.0, 37.0, np.uint32, 3.0),  # many coordinates clipped
    (0.3, 1000.3, 3.0, 1.7, np.uint32, 0.2),  # offset W*c*scale not an integer
    (0.5, 2.0**6, 2.0, 0.0, np.uint16, 1.0),  # weight 0; 16-bit words
    (0.5, 255.0, 1.0, 1.0, np.uint8, 0.4),  # 8-bit words, values up to 255
    (2.0, 2.0**30, 100.0, 99.0, np.uint64, 1.0),  # 64-bit words, level < 2^51
])
def test_nearest_rounding_equals_the_reference(clip, scale, max_weight, weight, dtype, spread):
    x = _update(1, spread)
    out = np.empty(D + 1, dtype)
    kw = {"clip_range": clip, "scale": scale, "max_weight": max_weight}
    quantize_weighted_into(x, weight, rounding="nearest", out=out, **kw)
    bits = 32 if dtype != np.uint64 else 64
    ref = quantize_weighted(x, weight, bits=bits, rounding="nearest", **kw)
    np.testing.assert_array_equal(out.astype(np.uint64), ref.astype(np.uint64))
    assert int(out.max()) <= max_level(clip, scale, max_weight)



@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantizing_on_threads_equals_one_thread(rounding, monkeypatch):
    d = PARALLEL_COORDS + 3 * CHUNK + 17  # spans of whole chunks, the last one partial
    x = (np.random.default_rng(5).standard_normal(d) * 0.5).astype(np.float32)
    kw = {"clip_range": 1.0, "scale": 2.0**20, "max_weight": 50.0, "rounding": rounding}
    one, many = np.empty(d + 1, np.uint32), np.empty(d + 1, np.uint32)
    quantize_weighted_into(x, 37.0, rng=np.random.default_rng(9), out=one, threads=1, **kw)
    every_thread_works(monkeypatch)
    before = worker_cpu_seconds()
    quantize_weighted_into(x, 37.0, rng=np.random.default_rng(9), out=many, threads=3, **kw)
    assert worker_cpu_seconds() > before  # the spans ran on the worker threads
    np.testing.assert_array_equal(many, one)  # stochastic: each span's noise stream seeked


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_quantizing_on_threads_finds_a_non_finite_value_in_any_span(bad):
    d = PARALLEL_COORDS + CHUNK
    x = np.zeros(d, np.float32)
    x[-1] = bad  # in the last span only
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weighted_into(x, 1.0, clip_range=1.0, scale=2.0**20, rounding="nearest",
                               out=np.empty(d + 1, np.uint32), threads=4)

def test_levels_beyond_2_pow_51_take_the_conversion_path():
    x = _update(2, 0.5)
    kw = {"clip_range": 1.0, "scale": 2.0**51, "max_weight": 1.0}  # level 2^52
    out = np.empty(D + 1, np.uint64)
    quantize_weighted_into(x, 1.0, rounding="nearest", out=out, **kw)
    exact = (np.clip(x.astype(np.float64), -1, 1) + 1.0) * 2.0**51
    diff = out[:-1].astype(np.float64) - exact
    assert np.all(np.abs(diff) < 1)  # float64 has half-unit steps here: rounded twice
    assert out.max() > 1 << 51  # the trick's 51-bit mask would have cut these


def test_levels_of_2_pow_63_and_more_keep_the_top_bit():
    x = np.array([-1.0, -0.25, 0.0, 0.4, 1.0, 3.0], np.float32)
    scale = 1.5 * 2.0**61
    kw = {"clip_range": 1.0, "scale": scale, "max_weight": 2.0}
    out = np.empty(x.size + 1, np.uint64)
    quantize_weighted_into(x, 2.0, rounding="nearest", out=out, **kw)
    level = max_level(1.0, scale, 2.0)
    assert 1 << 63 < level < 1 << 64
    a = b = 2.0 * scale  # the same float64 operations, in Python
    exact = [round(max(-1.0, min(1.0, float(v))) * a + b) for v in x]
    assert [int(w) for w in out[:-1]] == exact
    assert sum(w >= 1 << 63 for w in exact) == 3  # stored with the top bit set
    assert exact[-1] == level


@pytest.mark.parametrize("dtype", [np.float64, np.int16])
def test_other_input_dtypes_give_the_float32_words(dtype):
    x = (np.random.default_rng(9).standard_normal(1000) * 20).astype(dtype)
    kw = {"clip_range": 16.0, "scale": 2.0**8, "max_weight": 1.0, "rounding": "nearest"}
    out = np.empty(x.size + 1, np.uint32)
    quantize_weighted_into(x, 1.0, out=out, **kw)
    ref = quantize_weighted(x.astype(np.float64), 1.0, bits=32, **kw)
    np.testing.assert_array_equal(out, ref)


def test_factor_scales_the_clipped_coordinates_only():
    x = _update(3, 2.0)
    kw = {"clip_range": 1.0, "scale": 2.0**12, "max_weight": 10.0}
    out = np.empty(D + 1, np.uint32)
    quantize_weighted_into(x, 4.0, rounding="nearest", factor=0.25, out=out, **kw)
    v = 4.0 * 0.25 * np.clip(x.astype(np.float64), -1, 1) * 2.0**12 + 10.0 * 2.0**12
    np.testing.assert_array_equal(out[:-1], np.rint(v).astype(np.uint32))
    assert out[-1] == round(4.0 * 2.0**12)


def test_stochastic_rounding_is_floor_or_ceil_unbiased_and_reproducible():
    x = _update(4, 0.4)
    kw = {"clip_range": 1.0, "scale": 2.0**10, "max_weight": 5.0}
    v = 3.0 * np.clip(x.astype(np.float64), -1, 1) * 2.0**10 + 5.0 * 2.0**10

    def draw(seed: int) -> np.ndarray:
        out = np.empty(D + 1, np.uint32)
        quantize_weighted_into(x, 3.0, rounding="stochastic", rng=np.random.default_rng(seed),
                               out=out, **kw)
        return out

    a, b, c = draw(7), draw(7), draw(8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    err = a[:-1].astype(np.float64) - v
    assert np.all((err > -1) & (err < 1))
    assert np.all((a[:-1] == np.floor(v)) | (a[:-1] == np.ceil(v)))
    frac = v - np.floor(v)
    up = a[:-1] > np.floor(v)
    # P(round up) = frac(v): the mean error is 0 within 5 standard errors
    assert abs(err.mean()) < 5 * np.sqrt(np.mean(frac * (1 - frac)) / D)
    assert abs(up.mean() - frac.mean()) < 5 * np.sqrt(0.25 / D)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_updates_are_refused(rounding, bad):
    x = _update(5, 0.1)
    x[D - 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weighted_into(x, 1.0, clip_range=1.0, scale=2.0**10, rounding=rounding,
                               out=np.empty(D + 1, np.uint32))


@pytest.mark.parametrize("clip", [0.1, 0.5, 1.0, 1e-45, 3.4e38, 1e39])
def test_the_client_counts_clipped_coordinates_as_the_float64_comparison(clip):
    """The client's encoding pass counts float32 values on both sides of the clip and of its
    float32 neighbours as comparing them in float64 does."""
    c32 = np.float32(clip)
    near = [np.nextafter(c32, np.float32(np.inf)), c32, np.nextafter(c32, np.float32(0))]
    x = np.array([*near, *(-v for v in near), 0.0], dtype=np.float32)
    x = np.concatenate([x[np.isfinite(x)], _update(1, 0.3)])
    expected = int(np.count_nonzero(np.abs(x.astype(np.float64)) > clip))
    for values in (x, x.astype(np.float64)):
        got = quantize_into(values, 1.0, clip_range=clip, scale=2.0**16 / max(clip, 1.0),
                            max_weight=1.0, rounding="nearest",
                            out=np.empty(values.size + 1, np.uint32))
        assert got == expected


def test_words_too_narrow_for_the_level_are_refused():
    with pytest.raises(ValueError, match="cannot hold level"):
        quantize_weighted_into(_update(6, 0.1), 1.0, clip_range=1.0, scale=2.0**10,
                               max_weight=100.0, rounding="nearest",
                               out=np.empty(D + 1, np.uint16))


# --- masking -----------------------------------------------------------------------------

@pytest.mark.parametrize(("bits", "dtype"), [(8, np.uint8), (12, np.uint16), (16, np.uint16)])
def test_masking_into_narrow_words_equals_the_wide_sum(bits, dtype):
    dim = 2 * CHUNK_BYTES // 4 + 5
    rng = np.random.default_rng(bits)
    x = rng.integers(0, 1 << bits, dim).astype(dtype)
    masks = [(os.urandom(32), -1), (os.urandom(32), 1), (os.urandom(32), -1)]
    out = np.empty(dim, dtype)
    combine([x], masks, dim, bits, out=out)  # the first mask's sign is negative
    wide = x.astype(np.int64)
    for seed, sign in masks:
        wide += sign * expand(seed, dim, bits).astype(np.int64)
    np.testing.assert_array_equal(out, (wide % (1 << bits)).astype(dtype))


@pytest.mark.parametrize(("bits", "dtype", "accumulate"), [
    (32, np.uint32, False), (32, np.uint32, True), (64, np.uint64, False), (12, np.uint16, True),
])
def test_masking_on_threads_equals_one_thread(bits, dtype, accumulate, monkeypatch):
    step = CHUNK_BYTES // word_dtype(bits).itemsize
    dim = 5 * step + 1234  # spans of whole chunks, the last one partial
    rng = np.random.default_rng(bits)
    vectors = [rng.integers(0, 1 << min(bits, 63), dim).astype(np.uint64),
               rng.integers(0, 1 << 16, dim).astype(np.uint16)]
    masks = [(os.urandom(32), 1 if i % 3 else -1) for i in range(PARALLEL_WORDS // dim + 1)]
    start = rng.integers(0, 1 << bits, dim, dtype=np.uint64).astype(dtype)
    one, many = start.copy(), start.copy()
    combine(vectors, masks, dim, bits, out=one, accumulate=accumulate, threads=1)
    every_thread_works(monkeypatch)
    before = worker_cpu_seconds()
    combine(vectors, masks, dim, bits, out=many, accumulate=accumulate, threads=3)
    assert worker_cpu_seconds() > before  # the spans ran on the worker threads
    np.testing.assert_array_equal(many, one)


@pytest.mark.parametrize(("dim", "threads"), [(1, 4), (65536, 4), (5 * 65536 + 7, 3),
                                              (2 * 65536, 8), (10**6, 2)])
def test_thread_spans_cover_the_words_in_whole_chunks(dim, threads):
    spans = work_spans(dim, CHUNK_BYTES // 4, threads)
    assert spans[0][0] == 0 and spans[-1][1] == dim
    assert all(hi == lo for (_, hi), (lo, _) in itertools.pairwise(spans))
    assert all(lo % 65536 == 0 for lo, _ in spans)  # each starts on an AES block
    assert len(spans) == min(threads, -(-dim // 65536))


def test_masking_refuses_words_too_narrow_for_bits():
    with pytest.raises(ValueError, match="contiguous array"):
        combine([], [(os.urandom(32), 1)], 10, 17, out=np.empty(10, np.uint16))


# --- reused buffers ----------------------------------------------------------------------

def test_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    pool = BufferPool(max_bytes=1 << 24)
    size = 1 << 17
    a = pool.take(size)
    view = np.frombuffer(a, np.uint8)  # an array over the buffer keeps it in use
    del a
    first = id(view.base.obj)
    b = pool.take(size)
    second = id(b.obj)
    assert second != first
    del b
    c = pool.take(size)
    assert id(c.obj) == second  # nothing referred to it any more: reused
    del view
    gc.collect()
    d = pool.take(size)
    assert id(d.obj) == first and len(d) == size and not d.readonly


def test_pool_keeps_at_most_max_bytes():
    pool = BufferPool(max_bytes=3 << 17)
    held = [pool.take(1 << 17) for _ in range(5)]  # all in use: two are not kept
    assert pool.pooled_bytes <= 3 << 17
    assert len({id(v.obj) for v in held}) == 5
    del held
    pool.take(1 << 18)  # free buffers make room, least recently used first
    assert pool.pooled_bytes <= 3 << 17


def test_replies_kept_by_a_caller_survive_later_rounds():
    """A masked-input reply (SHARES_AND_INPUT in the merged flow) lives in a reused buffer:
    rounds after it must not touch it."""
    dim = 3 * CHUNK_BYTES // 4  # large enough to be pooled
    rng = np.random.default_rng(9)
    inputs = [rng.integers(0, 1 << 32, dim, dtype=np.uint64).astype(np.uint32)
              for _ in range(4)]
    kept: dict[int, memoryview] = {}
    copies: dict[int, bytes] = {}  # what each reply held when it was sent

    def keep(stage, src, dst, payload):
        if src is not None and read_header(payload).kind is MsgType.SHARES_AND_INPUT:
            kept[src], copies[src] = payload, bytes(payload)
        return payload

    total, _ = run_secagg_round(inputs, k=3, t=2, intercept=keep)
    assert len({id(p.obj) for p in kept.values()}) == len(kept) == 4
    expected = np.sum(inputs, axis=0, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(total, expected)
    for _ in range(3):
        again, _ = run_secagg_round(inputs[::-1], k=3, t=2, drop={1: Stage.UNMASKING})
        np.testing.assert_array_equal(again, expected)
    gc.collect()
    assert {c: bytes(p) for c, p in kept.items()} == copies
    assert all(decode_shares_and_input(p)[2].vector.size == dim for p in kept.values())
