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
"""

from __future__ import annotations

import math
import threading
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

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


def error_bound(n: int, scale: float, rounding: Rounding = "stochastic") -> float:
    """Bound on |decoded sum - exact sum| per coordinate for n summands."""
    return n / scale if rounding == "stochastic" else n / (2 * scale)


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


CHUNK = 1 << 15  # coordinates per step of quantize_weighted_into: its scratch stays in cache
_MAGIC = 1.5 * 2.0**52  # y + _MAGIC rounds y in [-2^51, 2^51] to an integer in the low bits


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
) -> np.ndarray:
    """:func:`quantize_weighted`'s encoding of ``update``, written into ``out`` (d+1 words).

    ``out`` may have any unsigned word that holds :func:`max_level`. ``factor`` in (0, 1]
    scales the clipped coordinates only (the sum then decodes to
    sum(weight * factor * clip(x)) and sum(weight)). Rounding to nearest breaks ties
    to even, as :func:`quantize_weighted` does; stochastic rounding is floor(v + U) with
    U uniform on [0, 1) in steps of 2^-32, drawn from an AES-128-CTR keystream keyed by
    16 bytes of ``rng`` (about five times cheaper than numpy's generator).

    Fast path: per cache-sized chunk, v = a * clip(x) + b is computed in float64 (as
    in the reference), then adding 1.5 * 2^52 leaves round(v) in the low bits of the
    float64 word (exact for 0 <= v < 2^51), which are narrowed into ``out`` without a
    float-to-integer conversion. Levels of 2^51 or more take numpy's conversion.
    """
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
    rng = rng if rng is not None else np.random.default_rng()
    stochastic = rounding == "stochastic"
    a, b = weight * factor * scale, max_weight * clip_range * scale
    if d:
        high, low = x.max(), x.min()
        if not (np.isfinite(high) and np.isfinite(low)):  # NaN propagates
            raise ValueError("update has non-finite values")
        clip = not (-clip_range <= low and high <= clip_range)
        _Encoder(a, b, clip_range if clip else None, level, stochastic, rng).run(x, out[:d])
    w = weight * scale + (rng.random() if stochastic else 0.5)
    out[d] = min(level, int(w))
    return out


class _Encoder:
    """Chunk by chunk: out = R(a * clip(x) + b), all values in [0, level]."""

    def __init__(self, a: float, b: float, clip: float | None, level: int, stochastic: bool,
                 rng: np.random.Generator) -> None:
        self.a, self.clip = np.float64(a), clip
        self.magic = level < 1 << 51
        self.offset = b - 0.5 if stochastic else b  # floor(v + U) = round(v + U - 1/2)
        # y + _MAGIC rounds y exactly; for a non-integral offset, add it first
        self.fold = float(self.offset).is_integer() and abs(self.offset) < 2**51
        self.noise = _stream_from(rng) if stochastic else None
        self.v, self.u, self.r = _scratch()

    def run(self, x: np.ndarray, out: np.ndarray) -> None:
        for start in range(0, x.size, CHUNK):
            stop = min(x.size, start + CHUNK)
            self._chunk(x[start:stop], out[start:stop])

    def _chunk(self, x: np.ndarray, out: np.ndarray) -> None:
        n = x.size
        v = self.v[:n]
        if self.clip is None:
            np.copyto(v, x)  # widening, then multiplying in place: faster than one mixed pass
        else:
            np.clip(x, -self.clip, self.clip, out=v)
        v *= self.a
        if self.noise is not None:  # U = 32 random bits / 2^32
            self.noise.update_into(_ZERO_BYTES[: 4 * n], self.r)
            u = self.u[:n]
            np.multiply(np.frombuffer(self.r, np.uint32, count=n), 2.0**-32, out=u,
                        dtype=np.float64)
            v += u
        if not self.magic:  # v + 1/2 >= 0: truncation rounds
            v += self.offset + 0.5
            np.copyto(out, v, casting="unsafe")
            return
        if self.fold:
            v += self.offset + _MAGIC
        else:
            v += self.offset
            v += _MAGIC
        low = v.view(np.uint64)  # 2^51 + round(v) in the low 52 bits
        if out.dtype.itemsize < 8:
            np.copyto(out, low, casting="unsafe")  # keeps the low bits: round(v)
        else:
            np.bitwise_and(low, np.uint64((1 << 51) - 1), out=out)


_ZERO_BYTES = memoryview(bytes(4 * CHUNK))
_LOCAL = threading.local()


def _scratch() -> tuple[np.ndarray, np.ndarray, bytearray]:
    """This thread's chunk buffers (values, noise, keystream), reused across calls: fresh
    ones would pay their page faults on every call."""
    scratch = getattr(_LOCAL, "scratch", None)
    if scratch is None:
        # update_into needs block-1 bytes of slack
        scratch = _LOCAL.scratch = (np.empty(CHUNK), np.empty(CHUNK), bytearray(4 * CHUNK + 15))
    return scratch


def _stream_from(rng: np.random.Generator) -> CipherContext:
    """An AES-128-CTR keystream keyed by 16 bytes of ``rng`` (rounding noise, not a secret)."""
    return Cipher(algorithms.AES(rng.bytes(16)), modes.CTR(bytes(16))).encryptor()


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
