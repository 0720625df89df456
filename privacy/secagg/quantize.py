"""Fixed-point encoding of (weighted) float updates into Z_(2^bits), and back.

A client with update x and weight w in [0, W] (W = ``max_weight``) sends

    q_i = R(scale * (w * clip(x_i, -c, c) + W * c))    for each coordinate i,
    q_d = R(scale * w)                                   as one extra coordinate,

with c = ``clip_range`` and R the rounding: stochastic by default (floor plus a
Bernoulli of the fractional part, unbiased; its generator only adds quantization
noise, nothing secret) or round-to-nearest. Every q lies in [0, L] with
L = :func:`max_level`, so the sum of n inputs lies in [0, n*L]; :func:`check_headroom`
proves n*L < 2^bits, so the secure sum mod 2^bits is the true integer sum. The
server decodes sum(w_i x_i) = S / scale - n*W*c and sum(w_i) = S_d / scale. Each
decoded coordinate is within n/scale (stochastic) or n/(2*scale) (nearest) of the
exact weighted sum of the clipped updates (see :func:`error_bound`); decoding
goes through float64, exact while n*L < 2^53.

Without a weight (:func:`quantize` / :func:`dequantize`) the same map is used
with w = W = 1 and no extra coordinate.

The round's figures the server needs travel in the sum too, as more words after the
weight (:class:`StatWords`): how many values the client clipped, its example count e
(at most E = ``max_examples``) and its example-weighted training loss e * (loss + R)
with the loss clipped to [-R, R] (R = ``loss_range``), as integers in base-(L+1)
digits, each within [0, L], so the headroom check covers them as well.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from privacy.secagg import workers
from privacy.secagg.encode_kernel import encode
from privacy.secagg.params import MAX_BITS, word_dtype

Rounding = Literal["stochastic", "nearest"]


def max_level(clip_range: float, scale: float, max_weight: float = 1.0) -> int:
    """Largest value one coordinate (or the weight coordinate) can quantize to."""
    if clip_range <= 0 or scale <= 0 or max_weight <= 0:
        raise ValueError("clip_range, scale and max_weight must be positive")
    return max(math.ceil(2 * max_weight * clip_range * scale), math.ceil(max_weight * scale))


def check_headroom(
    n: int, bits: int, clip_range: float, max_weight: float = 1.0, *, scale: float
) -> int:
    """Return the largest possible sum n*L; ValueError if it does not fit in bits."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [1, {MAX_BITS}], got {bits}")
    level = max_level(clip_range, scale, max_weight)
    worst = n * level
    if worst < 1 << bits:
        return worst
    need = worst.bit_length()
    fits_n = ((1 << bits) - 1) // level
    per_client = ((1 << bits) - 1) // n  # largest admissible L
    fits_clip = per_client / (2 * max_weight * scale)
    hint_bits = (
        f"raise bits to >= {need}" if need <= MAX_BITS else f"{need} bits needed (> {MAX_BITS})"
    )
    hint_clip = (
        f"lower clip_range to <= {fits_clip:.6g}"
        if per_client >= math.ceil(max_weight * scale)
        else "lower scale or max_weight (the weight coordinate alone overflows)"
    )
    raise ValueError(
        f"the sum of n={n} inputs can reach {worst} >= 2^{bits}: {hint_bits}, "
        f"or {hint_clip}, or lower n to <= {fits_n} (scale={scale}, max_weight={max_weight})"
    )


def max_scale(n: int, bits: int, clip_range: float, max_weight: float = 1.0) -> float:
    """The largest power-of-two scale that passes :func:`check_headroom`."""
    scale = 2.0 ** math.floor(math.log2(((1 << bits) - 1) / (n * 2 * max_weight * clip_range)))
    while scale > 0:
        try:
            check_headroom(n, bits, clip_range, max_weight, scale=scale)
            return scale
        except ValueError:
            scale /= 2
    raise ValueError("no positive scale fits")  # pragma: no cover


LOSS_RANGE = 256.0  # a training loss is clipped to [-LOSS_RANGE, LOSS_RANGE] for its total
LOSS_STEP = 2.0**-16  # the resolution of one client's examples * (loss + LOSS_RANGE)


def digit_count(top: int, base: int) -> int:
    """How many base-``base`` digits write every integer in [0, top]."""
    count, span = 1, base
    while span <= top:
        count, span = count + 1, span * base
    return count


@dataclass(frozen=True)
class StatWords:
    """The stat words after the weight: the values a client clipped, its example count
    e = min(examples, floor(max_examples)) and round(e * (loss + R) / LOSS_STEP) with the
    loss clipped to [-R, R] (R = ``loss_range``), each an exact integer written in
    base-(L+1) digits (L = ``level``) so that every word stays within [0, L]: the sum of
    n clients' words cannot wrap (:func:`check_headroom`) and decodes to the exact sums.
    """

    dim: int  # coordinates a client can clip
    level: int
    max_examples: float
    loss_range: float = LOSS_RANGE

    @property
    def _tops(self) -> tuple[int, int, int]:
        e = math.floor(self.max_examples)
        return self.dim + 2, e, e * round(2 * self.loss_range / LOSS_STEP)

    @property
    def words(self) -> int:
        return sum(digit_count(top, self.level + 1) for top in self._tops)

    def encode(self, clipped: int, examples: float, loss: float | None) -> np.ndarray:
        """One client's words: its ``clipped`` coordinates plus one for an example count
        above ``max_examples`` and one for a loss outside [-R, R] or not finite; its
        examples and loss. Without a loss (None) both are 0: the totals cover the
        clients that report one, as a plain round's mean does."""
        e_top = self._tops[1]
        e, value = 0, 0
        if loss is not None:
            e = min(max(round(examples), 0), e_top)
            clipped += int(examples > e_top)
            finite = math.isfinite(loss)
            clipped += int(not finite or abs(loss) > self.loss_range)
            kept = min(max(loss, -self.loss_range), self.loss_range) if finite \
                else self.loss_range
            value = round(e * (kept + self.loss_range) / LOSS_STEP)
        base = self.level + 1
        out = []
        for number, top in zip((min(clipped, self.dim + 2), e, value), self._tops, strict=True):
            for _ in range(digit_count(top, base)):
                number, digit = divmod(number, base)
                out.append(digit)
        return np.array(out, dtype=np.uint64)

    def decode(self, total: np.ndarray) -> tuple[int, float, float]:
        """(values clipped, examples, sum of examples * loss) from the sum of n clients'
        words: exact but for each client's rounding of its loss term (LOSS_STEP / 2)."""
        sums = [int(w) for w in np.asarray(total).reshape(-1)]
        if len(sums) != self.words:
            raise ValueError(f"expected {self.words} stat words, got {len(sums)}")
        base, values, at = self.level + 1, [], 0
        for top in self._tops:
            count = digit_count(top, base)
            values.append(sum(d * base**i for i, d in enumerate(sums[at:at + count])))
            at += count
        clipped, examples, value = values
        return clipped, float(examples), value * LOSS_STEP - self.loss_range * examples


def error_bound(n: int, scale: float, rounding: Rounding = "stochastic") -> float:
    """Bound on |decoded sum - exact sum| per coordinate for n summands."""
    return n / scale if rounding == "stochastic" else n / (2 * scale)


def decode_error_l2(dim: int, scale: float, rounding: Rounding, level: int) -> float:
    """Largest L2 distance between one input's decoded coordinates and what they encode.

    Alone, a client's ``dim`` coordinate words decode (q / scale - max_weight * clip_range)
    to weight * factor * clip(x) plus its rounding error: per coordinate at most half a
    step 1/scale to nearest, less than one step stochastically, plus the float64 rounding
    of computing and decoding a word (a few ulps of ``level``, counted as level * 2^-50);
    so sqrt(dim) times that in L2. Clamping to [0, level] never adds to it: the exact value
    lies in that range.
    """
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    step = (0.5 if rounding == "nearest" else 1.0) + level * 2.0**-50
    return math.sqrt(dim) * step / scale


def contribution_clip(bound: float, *, dim: int, scale: float, rounding: Rounding,
                      level: int, weight: float = 1.0) -> float:
    """The L2 norm to clip an update to so that its decoded contribution stays within
    ``bound`` (central DP under secure aggregation: the C its noise is calibrated to).

    The contribution is weight * factor * clip(x) + e with factor <= 1, clip to
    [-clip_range, clip_range] per coordinate (which only shrinks a vector) and
    ||e|| <= :func:`decode_error_l2`; so an update clipped to
    (bound - decode_error_l2) / max(weight, 1) decodes within ``bound``. A float32
    clip lands within 2^-23 of its target, so the target is lowered by 2^-20 more.
    Zero or less means no update fits: a finer scale (more bits) or a larger bound is needed.
    """
    margin = decode_error_l2(dim, scale, rounding, level)
    return (bound - margin) / max(weight, 1.0) * (1.0 - 2.0**-20)


def _round(
    v: np.ndarray, level: int, bits: int, rounding: Rounding, rng: np.random.Generator | None
) -> np.ndarray:
    if rounding == "stochastic":
        rng = rng if rng is not None else np.random.default_rng()
        low = np.floor(v)
        q = low + (rng.random(v.shape) < (v - low))
    elif rounding == "nearest":
        q = np.rint(v)
    else:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    np.clip(q, 0, level, out=q)
    return q.astype(word_dtype(bits))


def quantize_weighted(
    update: np.ndarray,
    weight: float,
    *,
    bits: int,
    clip_range: float,
    scale: float,
    max_weight: float = 1.0,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """d+1 words: the clipped, weighted, shifted update, then the weight."""
    if not 0.0 <= weight <= max_weight:
        raise ValueError(f"weight must be in [0, {max_weight}], got {weight}")
    level = max_level(clip_range, scale, max_weight)
    x = np.asarray(update, dtype=np.float64).ravel()
    if not np.all(np.isfinite(x)):
        raise ValueError("update has non-finite values")
    v = np.empty(x.size + 1)
    np.clip(x, -clip_range, clip_range, out=v[:-1])
    v[:-1] *= weight
    v[:-1] += max_weight * clip_range
    v[-1] = weight
    v *= scale
    return _round(v, level, bits, rounding, rng)


CHUNK = 1 << 15  # coordinates per keystream step of stochastic rounding: it stays in cache


def quantize_weighted_into(
    update: np.ndarray,
    weight: float,
    *,
    clip_range: float,
    scale: float,
    max_weight: float = 1.0,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
    factor: float = 1.0,
    out: np.ndarray,
    threads: int = 1,
) -> np.ndarray:
    """:func:`quantize_counting_into` without the count: ``out``."""
    _quantize_into(update, weight, clip_range=clip_range, scale=scale, max_weight=max_weight,
                   rounding=rounding, rng=rng, factor=factor, out=out, threads=threads,
                   count=False)
    return out


def quantize_counting_into(
    update: np.ndarray,
    weight: float,
    *,
    clip_range: float,
    scale: float,
    max_weight: float = 1.0,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
    factor: float = 1.0,
    out: np.ndarray,
    threads: int = 1,
) -> int:
    """:func:`quantize_weighted`'s encoding of ``update``, written into ``out`` (d+1 words);
    returns how many coordinates of ``update`` lie outside [-clip_range, clip_range]
    (compared in float64), counted in the same pass.

    ``out`` may have any unsigned word that holds :func:`max_level`. ``factor`` in (0, 1]
    scales the clipped coordinates only (the sum then decodes to
    sum(weight * factor * clip(x)) and sum(weight)). Rounding to nearest breaks ties
    to even, as :func:`quantize_weighted` does; stochastic rounding is floor(v + U) with
    U uniform on [0, 1) in steps of 2^-32, drawn from an AES-128-CTR keystream keyed by
    16 bytes of ``rng`` (about five times cheaper than numpy's generator).

    One compiled pass (:func:`privacy.secagg.encode_kernel.encode`) computes
    v = a * clip(x) + b in float64, rounds, clamps and stores each word, and finds any
    NaN or infinity (and counts the clipped coordinates) on the way; stochastic noise is
    generated chunk by chunk beside it.
    With ``threads`` > 1 and at least :data:`PARALLEL_COORDS` coordinates, the chunks are
    shared among threads (:func:`privacy.secagg.workers.share`; a noise stream starts at
    the block of the first chunk of each contiguous range a thread takes), with the same
    result.
    """
    return _quantize_into(update, weight, clip_range=clip_range, scale=scale,
                          max_weight=max_weight, rounding=rounding, rng=rng, factor=factor,
                          out=out, threads=threads, count=True)


def _quantize_into(update: np.ndarray, weight: float, *, clip_range: float, scale: float,
                   max_weight: float, rounding: Rounding, rng: np.random.Generator | None,
                   factor: float, out: np.ndarray, threads: int, count: bool) -> int:
    x = np.asarray(update).reshape(-1)
    d = x.size
    if out.shape != (d + 1,) or out.dtype.kind != "u" or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous unsigned array of {d + 1} words, "
                         f"has {out.dtype} {out.shape}")
    if not 0.0 <= weight <= max_weight:
        raise ValueError(f"weight must be in [0, {max_weight}], got {weight}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if not 0 < factor <= 1:
        raise ValueError(f"factor must be in (0, 1], got {factor}")
    level = max_level(clip_range, scale, max_weight)
    if level >> (8 * out.dtype.itemsize):
        raise ValueError(f"{out.dtype} words cannot hold level {level}")
    clipped = 0
    # the rounding noise's generator; rounding to nearest draws nothing
    gen = (rng if rng is not None else np.random.default_rng()) if rounding == "stochastic" \
        else None
    if d:
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        a, b = weight * factor * scale, max_weight * clip_range * scale
        top = float(level)
        if int(top) > level:  # rounded up (levels above 2^53): stay within the words
            top = math.nextafter(top, 0.0)
        args = (float(a), float(b), float(clip_range), top)
        noise_key = gen.bytes(16) if gen is not None else b""  # AES key, not a secret
        counts = workers.share(d, CHUNK, threads if d >= PARALLEL_COORDS else 1,
                               functools.partial(_encode_chunks, x, out, args, noise_key, count))
        if min(counts) < 0:
            raise ValueError("update has non-finite values")
        clipped = sum(counts)
    w = weight * scale + (gen.random() if gen is not None else 0.5)
    out[d] = min(level, int(w))
    return clipped


PARALLEL_COORDS = 1 << 18  # coordinates below which one thread encodes them all


def _encode_chunks(x: np.ndarray, out: np.ndarray, args: tuple[float, ...], noise_key: bytes,
                   count: bool, chunks: Iterator[tuple[int, int]]) -> int:
    """Encode one thread's chunks of coordinates (each [lo, hi) with ``lo`` a multiple of
    CHUNK); -1 if one is not finite, else (with ``count``) how many it clipped.

    Stochastically, each chunk takes its own slice of the noise keystream of
    ``noise_key``: the stream goes on from chunk to chunk and starts again at the chunk's
    block where the thread took over another thread's rest.
    """
    total, finite = 0, True
    buf = _scratch() if noise_key else None
    words = np.frombuffer(buf, np.uint32, count=CHUNK) if buf is not None else _NO_NOISE
    noise, at = None, -1
    for lo, hi in chunks:
        n = hi - lo
        if buf is not None:
            if lo != at:
                noise = Cipher(algorithms.AES(noise_key),
                               modes.CTR((4 * lo // 16).to_bytes(16, "big"))).encryptor()
            noise.update_into(_ZERO_BYTES[: 4 * n], buf)  # type: ignore[union-attr]
        got = encode(x[lo:hi], words[:n], out[lo:hi], *args, count)
        finite &= got >= 0
        total += got
        at = hi
    return int(total) if finite else -1


_NO_NOISE = np.empty(0, np.uint32)
_ZERO_BYTES = memoryview(bytes(4 * CHUNK))
_LOCAL = threading.local()


def _scratch() -> bytearray:
    """This thread's keystream chunk, reused across calls (a fresh one would pay its page
    faults on every call); update_into needs block-1 bytes of slack."""
    scratch = getattr(_LOCAL, "scratch", None)
    if scratch is None:
        scratch = _LOCAL.scratch = bytearray(4 * CHUNK + 15)
    return scratch


def dequantize_weighted(
    total: np.ndarray,
    n: int,
    *,
    clip_range: float,
    scale: float,
    max_weight: float = 1.0,
) -> tuple[np.ndarray, float]:
    """(sum of w_i * clip(x_i), sum of w_i) from the sum of n quantized inputs."""
    s = np.asarray(total).astype(np.float64)
    weight = float(s[-1] / scale)
    out = s[:-1]  # in place: no more d-sized temporaries
    out /= scale
    out -= n * max_weight * clip_range
    return out, weight


def quantize(
    x: np.ndarray,
    *,
    bits: int,
    clip_range: float,
    scale: float,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """d words: round(scale * (clip(x) + clip_range))."""
    v = np.asarray(x, dtype=np.float64).ravel()
    if not np.all(np.isfinite(v)):
        raise ValueError("input has non-finite values")
    v = (np.clip(v, -clip_range, clip_range) + clip_range) * scale
    return _round(v, max_level(clip_range, scale), bits, rounding, rng)


def dequantize(total: np.ndarray, n: int, *, clip_range: float, scale: float) -> np.ndarray:
    """Sum of the n clipped inputs from the sum of their quantizations."""
    return np.asarray(total).astype(np.float64) / scale - n * clip_range
