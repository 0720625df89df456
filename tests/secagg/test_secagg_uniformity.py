"""Masked inputs look uniform mod 2^bits whatever the input."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from privacy.secagg import run_secagg_round
from privacy.secagg.messages import MsgType, decode_masked_input, read_header

DIM = 1 << 15
TOP_BITS = 4


def _top_bits_pvalue(words: np.ndarray, bits: int) -> float:
    buckets = (words.astype(np.uint64) >> np.uint64(bits - TOP_BITS)).astype(np.int64)
    counts = np.bincount(buckets, minlength=1 << TOP_BITS)
    assert counts.size == 1 << TOP_BITS  # nothing at or above 2^bits
    return chisquare(counts).pvalue


def _masked_vectors(inputs: list[np.ndarray], bits: int) -> dict[int, np.ndarray]:
    seen = {}

    def spy(stage, src, dst, payload):
        if src is not None and read_header(payload).kind is MsgType.MASKED_INPUT:
            seen[src] = decode_masked_input(payload)[1].vector.copy()
        return payload

    total, _ = run_secagg_round(inputs, k=2, t=2, bits=bits, intercept=spy)
    assert total is not None
    return seen


@pytest.mark.parametrize("bits", [32, 20, 64])
@pytest.mark.parametrize("fill", ["zero", "constant"])
def test_masked_vectors_are_uniform(bits, fill):
    dtype = np.uint32 if bits <= 32 else np.uint64
    value = 0 if fill == "zero" else (1 << (bits - 1)) + 12345
    inputs = [np.full(DIM, value, dtype=dtype) for _ in range(3)]
    assert _top_bits_pvalue(inputs[0], bits) < 1e-6  # the test does see a constant
    for y in _masked_vectors(inputs, bits).values():
        assert _top_bits_pvalue(y, bits) > 1e-6
        assert len(np.unique(y[:1000])) > 990  # no repeated structure either
