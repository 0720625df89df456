"""Mask expansion matches its specification, across chunk boundaries and bit widths."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.secagg.prg import CHUNK_BYTES, combine, expand


def _reference_mask(seed: bytes, dim: int, bits: int) -> list[int]:
    """HKDF-SHA256 -> AES-128-CTR(zero IV) keystream -> little-endian words mod 2^bits."""
    key = HKDF(hashes.SHA256(), 16, None, b"fedring-secagg/prg/aes128-ctr").derive(seed)
    word = 4 if bits <= 32 else 8
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(dim * word))
    return [
        int.from_bytes(stream[i : i + word], "little") % (1 << bits)
        for i in range(0, dim * word, word)
    ]


@pytest.mark.parametrize("bits", [1, 20, 32, 33, 64])
def test_expand_matches_the_specification_across_chunks(bits):
    word = 4 if bits <= 32 else 8
    dim = 2 * CHUNK_BYTES // word + 7  # three chunks, the last one partial
    seed = os.urandom(32)
    mask = expand(seed, dim, bits)
    assert mask.dtype == np.dtype(f"<u{word}") and mask.shape == (dim,)
    ref = _reference_mask(seed, dim, bits)
    idx = np.r_[0:50, CHUNK_BYTES // word - 3 : CHUNK_BYTES // word + 3, dim - 50 : dim]
    assert [int(mask[i]) for i in idx] == [ref[i] for i in idx]
    assert not np.array_equal(mask, expand(os.urandom(32), dim, bits))


@pytest.mark.parametrize("bits", [13, 32, 64])
def test_combine_is_the_signed_sum_mod_2_bits(bits):
    rng = np.random.default_rng(bits)
    dim = CHUNK_BYTES // 4 + 11
    vectors = [rng.integers(0, 1 << min(bits, 62), dim, dtype=np.int64) for _ in range(3)]
    seeds = [os.urandom(32) for _ in range(4)]
    signs = [1, -1, -1, 1]
    got = combine(vectors, list(zip(seeds, signs, strict=True)), dim, bits)
    expected = [0] * dim
    for v in vectors:
        expected = [e + int(x) for e, x in zip(expected, v.tolist(), strict=True)]
    for seed, sign in zip(seeds, signs, strict=True):
        ref = _reference_mask(seed, dim, bits)
        expected = [e + sign * r for e, r in zip(expected, ref, strict=True)]
    assert got.tolist() == [e % (1 << bits) for e in expected]


def test_masks_cancel_when_added_and_subtracted():
    seed, dim = os.urandom(32), 1000
    x = np.arange(dim, dtype=np.uint32)
    out = np.empty(dim, dtype="<u4")
    combine([x], [(seed, 1), (seed, -1)], dim, 32, out=out)
    np.testing.assert_array_equal(out, x)
    with pytest.raises(ValueError, match="contiguous array"):
        combine([x], [], dim, 32, out=np.empty(dim, dtype=np.uint64))


@pytest.mark.parametrize("bits", [13, 32])
def test_combine_can_add_into_what_out_holds(bits):
    rng = np.random.default_rng(3)
    dim = CHUNK_BYTES // 4 + 5
    start = rng.integers(0, 1 << 32, dim, dtype=np.uint64).astype("<u4")  # not yet mod 2^bits
    masks = [(os.urandom(32), 1), (os.urandom(32), -1)]
    out = start.copy()
    assert combine([], masks, dim, bits, out=out, accumulate=True) is out
    expected = (start.astype(np.uint64) + combine([], masks, dim, 32)) % (1 << bits)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="accumulate needs out"):
        combine([], masks, dim, bits, accumulate=True)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_thread_s_chunks_out_of_order_give_the_same_words(accumulate):
    """A thread that took over another thread's rest starts its streams again at the
    chunk it took (AES-CTR seeks): chunks in any order, with jumps, give combine's words."""
    from privacy.secagg import prg

    step = prg.CHUNK_BYTES // 4
    dim = 4 * step + 99
    rng = np.random.default_rng(3)
    x = rng.integers(0, 1 << 32, dim, dtype=np.uint64).astype(np.uint32)
    masks = [(bytes([i]) * 32, 1 if i % 2 else -1) for i in range(3)]
    start = rng.integers(0, 1 << 32, dim, dtype=np.uint64).astype(np.uint32)
    want = combine([x], masks, dim, 32, out=start.copy(), accumulate=accumulate)
    got = start.copy()
    keys = [(prg.prg_key(seed), sign) for seed, sign in masks]
    order = [(3 * step, 4 * step), (4 * step, dim), (0, step), (2 * step, 3 * step),
             (step, 2 * step)]
    prg._fill([x], keys, 32, got, accumulate, iter(order))
    np.testing.assert_array_equal(got, want)
