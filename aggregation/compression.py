"""Update compression: QSGD stochastic quantization and top-k sparsification with error
feedback. Clients encode their delta, the server decodes it back to a dense float32 delta.

Both messages serialise to a compact wire format (``to_bytes``/``from_bytes``) and say how
many bytes that is (``nbytes``), so runs can record what compression saved.

:class:`CompressionConfig` is the ``[compression]`` scenario section and
:class:`RoundCodec` the codec of one round that client and server both build from it:
``encode`` turns a delta into a few compact arrays (bit-packed QSGD levels and per-bucket
norms; uint32 indices and float32 values for top-k; values alone for rand-k on a shared
pattern), ``decode`` checks such arrays strictly and returns the dense delta.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KINDS", "CompressionConfig", "QSGDMessage", "RoundCodec", "SparseDelta", "TopK",
           "qsgd_decode", "qsgd_dequantize", "qsgd_encode", "qsgd_quantize", "shared_pattern",
           "topk_encode"]

_QSGD_HEADER = struct.Struct("<IBf")  # dim, bits, norm
_TOPK_HEADER = struct.Struct("<II")  # dim, k


def _rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _pack(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers < 2**width into ``width`` bits each (little-endian)."""
    planes = (values[:, None] >> np.arange(width, dtype=np.uint32)) & 1
    return np.packbits(planes.astype(np.uint8).ravel(), bitorder="little").tobytes()


def _unpack(buf: bytes | np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`_pack`; ``buf`` must hold at least ``count * width`` bits."""
    raw = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytes | bytearray) else buf
    bits = np.unpackbits(raw, count=count * width, bitorder="little").reshape(count, width)
    return (bits.astype(np.uint32) << np.arange(width, dtype=np.uint32)).sum(axis=1,
                                                                             dtype=np.uint32)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"QSGD bits must be an integer in [1, 16], got {bits!r}")
    return (1 << bits) - 1


def _bucket(dim: int, bucket_size: int) -> int:
    """Coordinates per norm: ``bucket_size``, or the whole vector when it is 0."""
    return bucket_size if 0 < bucket_size < dim else max(dim, 1)


def qsgd_quantize(delta: np.ndarray, bits: int, bucket_size: int = 0,
                  seed: int | np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """QSGD (Alistarh et al. 2017) with ``s = 2**bits - 1`` levels and one norm per bucket.

    Returns (float32 norms, one per ``bucket_size`` coordinates or one for all when it is
    0; int32 signed levels in [-s, s]). Coordinate ``v_i`` of a bucket with norm ``|v|``
    becomes ``|v| * sign(v_i) * l_i / s`` where ``l_i`` is ``floor(s |v_i| / |v|)`` or
    that plus one, the latter with probability equal to the fractional part, so
    ``E[decode(encode(v))] = v``. Each float32 norm is rounded up, so every level is <= s.
    """
    s = _check_bits(bits)
    v = np.asarray(delta, dtype=np.float32).ravel()
    size = _bucket(v.size, bucket_size)
    count = -(-v.size // size)
    v64 = v.astype(np.float64)
    squares = np.zeros(count * size)
    np.multiply(v64, v64, out=squares[:v.size])
    norms = np.sqrt(squares.reshape(count, size).sum(axis=1))
    if not np.all(np.isfinite(norms)):
        raise ValueError("cannot quantize a delta with NaN/Inf values")
    norms32 = norms.astype(np.float32)
    low = norms32.astype(np.float64) < norms
    norms32[low] = np.nextafter(norms32[low], np.float32(np.inf))
    if not np.all(np.isfinite(norms32)):
        raise ValueError("cannot quantize a delta whose norm overflows float32")
    per = np.repeat(norms32.astype(np.float64), size)[:v.size]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(per > 0, np.abs(v64) * (s / per), 0.0)
    floor = np.floor(r)
    levels = floor + (_rng(seed).random(v.size) < (r - floor))
    np.minimum(levels, s, out=levels)
    return norms32, np.where(v < 0, -levels, levels).astype(np.int32)


def qsgd_dequantize(norms: np.ndarray, levels: np.ndarray, bits: int,
                    bucket_size: int = 0) -> np.ndarray:
    """The dense float32 delta of :func:`qsgd_quantize`'s norms and levels."""
    s = _check_bits(bits)
    size = _bucket(levels.size, bucket_size)
    scale = np.repeat(np.asarray(norms, dtype=np.float64) / s, size)[:levels.size]
    return (levels * scale).astype(np.float32)


@dataclass(frozen=True)
class QSGDMessage:
    """A QSGD-quantized delta: ``norm * levels / (2**bits - 1)``, levels in ``[-s, s]``."""

    dim: int
    bits: int
    norm: float  # float32-representable
    levels: np.ndarray  # int32, shape (dim,)

    @property
    def s(self) -> int:
        return (1 << self.bits) - 1

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: a 9-byte header and ``bits + 1`` bits (sign and level) each."""
        return _QSGD_HEADER.size + math.ceil(self.dim * (self.bits + 1) / 8)

    def to_bytes(self) -> bytes:
        offset = (self.levels.astype(np.int64) + self.s).astype(np.uint32)
        return _QSGD_HEADER.pack(self.dim, self.bits, self.norm) + _pack(offset, self.bits + 1)

    @classmethod
    def from_bytes(cls, data: bytes) -> QSGDMessage:
        dim, bits, norm = _QSGD_HEADER.unpack_from(data)
        offset = _unpack(data[_QSGD_HEADER.size:], bits + 1, dim)
        levels = offset.astype(np.int32) - np.int32((1 << bits) - 1)
        return cls(dim=dim, bits=bits, norm=norm, levels=levels)


def qsgd_encode(delta: np.ndarray, bits: int,
                seed: int | np.random.Generator | None = None) -> QSGDMessage:
    """QSGD of the whole vector with one norm (:func:`qsgd_quantize` with no buckets).

    ``seed`` (an int or a Generator) makes the rounding reproducible.
    """
    norms, levels = qsgd_quantize(delta, bits, 0, seed)
    return QSGDMessage(dim=levels.size, bits=bits, norm=float(norms[0]), levels=levels)


def qsgd_decode(msg: QSGDMessage) -> np.ndarray:
    """The dense float32 delta a QSGD message stands for."""
    return qsgd_dequantize(np.array([msg.norm]), msg.levels, msg.bits)


@dataclass(frozen=True)
class SparseDelta:
    """A sparse delta: ``values`` at sorted ``indices`` (uint32), zero elsewhere."""

    dim: int
    indices: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: an 8-byte header and 4 + 4 bytes per kept coordinate."""
        return _TOPK_HEADER.size + 8 * int(self.indices.size)

    def to_bytes(self) -> bytes:
        return (_TOPK_HEADER.pack(self.dim, int(self.indices.size))
                + self.indices.astype("<u4").tobytes() + self.values.astype("<f4").tobytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> SparseDelta:
        dim, k = _TOPK_HEADER.unpack_from(data)
        start = _TOPK_HEADER.size
        indices = np.frombuffer(data, dtype="<u4", count=k, offset=start).astype(np.uint32)
        values = np.frombuffer(data, dtype="<f4", count=k, offset=start + 4 * k)
        return cls(dim=dim, indices=indices, values=values.astype(np.float32))

    def decode(self) -> np.ndarray:
        """The dense float32 delta (server side)."""
        out = np.zeros(self.dim, dtype=np.float32)
        out[self.indices] = self.values
        return out


def topk_encode(delta: np.ndarray, k: int) -> SparseDelta:
    """The ``k`` largest-magnitude coordinates of ``delta`` (ties broken arbitrarily)."""
    v = np.asarray(delta, dtype=np.float32).ravel()
    k = min(int(k), v.size)
    if k <= 0:
        return SparseDelta(v.size, np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.float32))
    idx = np.argpartition(np.abs(v), v.size - k)[v.size - k:] if k < v.size else \
        np.arange(v.size)
    idx = np.sort(idx).astype(np.uint32)
    return SparseDelta(v.size, idx, v[idx].copy())


class TopK:
    """Client-side top-k sparsification with error feedback (Stich et al. 2018, Lin et al.
    2018): each round sends the top-k of ``delta + residual`` and keeps the rest as the new
    residual, so nothing is dropped, only delayed.

    Give ``k`` (coordinates per round) or ``ratio`` (fraction of the dimension, at least 1).
    ``error_feedback=False`` is plain top-k (the rest is dropped).
    """

    def __init__(self, k: int | None = None, *, ratio: float | None = None,
                 error_feedback: bool = True) -> None:
        if (k is None) == (ratio is None):
            raise ValueError("give exactly one of k and ratio")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top-k k must be a positive integer, got {k!r}")
        if ratio is not None and not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.k, self.ratio, self.error_feedback = k, ratio, error_feedback
        self.residual: np.ndarray | None = None

    def k_for(self, dim: int) -> int:
        if self.k is not None:
            return min(self.k, dim)
        assert self.ratio is not None
        return max(1, min(dim, math.ceil(self.ratio * dim)))

    def encode(self, delta: np.ndarray) -> SparseDelta:
        """Sparsify this round's delta (plus the carried residual)."""
        v = np.asarray(delta, dtype=np.float32).ravel()
        if not self.error_feedback:
            return topk_encode(v, self.k_for(v.size))
        if self.residual is None:
            u = v.copy()  # never write into the caller's array
        elif self.residual.shape != v.shape:
            raise ValueError(f"delta has {v.size} values, the residual {self.residual.size}")
        else:
            u = v + self.residual
        msg = topk_encode(u, self.k_for(u.size))
        u[msg.indices] = 0.0
        self.residual = u
        return msg

    def state_dict(self) -> dict[str, Any]:
        return {"residual": None if self.residual is None else self.residual.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = state.get("residual")
        self.residual = None if r is None else np.asarray(r, dtype=np.float32).copy()


# --- the [compression] section and one round's codec ----------------------------------

KINDS = ("none", "qsgd", "topk")
DEFAULT_FRACTION = 0.1  # top-k keeps this fraction when neither fraction nor k is given


@dataclass(frozen=True)
class CompressionConfig:
    """``[compression]``: how clients compress the delta they upload.

    ``kind``: "none", "qsgd" (``bits`` per level plus a sign, one float32 norm per
    ``bucket_size`` coordinates, 0 for one norm) or "topk" (``fraction`` of the
    coordinates or exactly ``k``). ``error_feedback``: a client adds what compression
    left out of its last uploads to its next delta (Seide et al. 2014, Stich et al.
    2018); on by default for top-k, off for QSGD, which is unbiased and whose residual
    grows when its variance exceeds the update's norm (few bits, large buckets).
    ``shared_pattern`` (top-k only): every client sends the same pseudo-random ``k``
    coordinates of the round, derived from (run, round): rand-k, values only.
    """

    kind: str = "none"
    bits: int = 4
    bucket_size: int = 512
    fraction: float = 0.0
    k: int = 0
    error_feedback: bool | None = None  # None: on for top-k, off for QSGD
    shared_pattern: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"compression.kind '{self.kind}' is unknown; choose one of: "
                             f"{', '.join(KINDS)}")
        if isinstance(self.bits, bool) or not 1 <= self.bits <= 16:
            raise ValueError(f"compression.bits must be in [1, 16] (QSGD levels per sign), "
                             f"got {self.bits}")
        if self.bucket_size < 0:
            raise ValueError(f"compression.bucket_size must be >= 0 (0: one norm for the "
                             f"whole update), got {self.bucket_size}")
        if not 0 <= self.fraction <= 1 or self.k < 0:
            raise ValueError(f"compression.fraction must be in [0, 1] and compression.k >= 0 "
                             f"(0: not set), got fraction={self.fraction}, k={self.k}")
        if self.fraction > 0 and self.k > 0:
            raise ValueError("give compression.fraction or compression.k, not both")
        if self.kind == "topk" and self.fraction == 0 and self.k == 0:
            object.__setattr__(self, "fraction", DEFAULT_FRACTION)
        if self.error_feedback is None:
            object.__setattr__(self, "error_feedback", self.kind == "topk")
        elif not isinstance(self.error_feedback, bool):
            raise ValueError(f"compression.error_feedback must be true or false, got "
                             f"{self.error_feedback!r}")
        if self.shared_pattern and self.kind != "topk":
            raise ValueError(f"compression.shared_pattern applies to kind = 'topk', not "
                             f"'{self.kind}'")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def k_for(self, dim: int) -> int:
        """Coordinates a top-k upload keeps out of ``dim``."""
        if self.k > 0:
            return min(self.k, dim)
        return max(1, min(dim, math.ceil(self.fraction * dim)))


def shared_pattern(run: int, rnd: int, dim: int, k: int) -> np.ndarray:
    """The sorted uint32 coordinates every client of round ``rnd`` of ``run`` sends (rand-k).

    Not secret: any party that knows the run and round can derive it.
    """
    if dim >= 1 << 32:
        raise ValueError(f"a shared pattern indexes at most 2^32 coordinates, got {dim}")
    rng = np.random.default_rng([run, rnd, 0x5EED])
    return np.sort(rng.choice(dim, size=min(k, dim), replace=False)).astype(np.uint32)


def _array(arrays: Mapping[str, np.ndarray], name: str, dtype: type, size: int) -> np.ndarray:
    a = arrays[name]
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"'{name}' has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if a.shape != (size,):
        raise ValueError(f"'{name}' has shape {a.shape}, expected ({size},)")
    return a


def _finite(a: np.ndarray, name: str) -> None:
    bad = int(np.count_nonzero(~np.isfinite(a)))
    if bad:
        raise ValueError(f"'{name}' has {bad} NaN/Inf values")


@dataclass(frozen=True)
class RoundCodec:
    """One round's codec of a :class:`CompressionConfig` for vectors of ``dim`` values.

    ``pattern`` is the round's shared coordinate set (rand-k), or None.
    """

    config: CompressionConfig
    dim: int
    pattern: np.ndarray | None = None

    @classmethod
    def for_round(cls, config: CompressionConfig, dim: int, *, run: int,
                  rnd: int) -> RoundCodec:
        pattern = (shared_pattern(run, rnd, dim, config.k_for(dim))
                   if config.shared_pattern else None)
        return cls(config, dim, pattern)

    @property
    def names(self) -> tuple[str, ...]:
        """The arrays of an encoded update."""
        if self.config.kind == "qsgd":
            return ("norms", "codes")
        return ("values",) if self.pattern is not None else ("indices", "values")

    @property
    def _buckets(self) -> int:
        return -(-self.dim // _bucket(self.dim, self.config.bucket_size))

    def encode(self, delta: np.ndarray,
               seed: int | np.random.Generator | None = None) -> dict[str, np.ndarray]:
        """The compact arrays of ``delta`` (which is left untouched)."""
        v = np.asarray(delta, dtype=np.float32).ravel()
        if v.size != self.dim:
            raise ValueError(f"delta has {v.size} values, the codec expects {self.dim}")
        cfg = self.config
        if cfg.kind == "qsgd":
            norms, levels = qsgd_quantize(v, cfg.bits, cfg.bucket_size, seed)
            offsets = (levels + np.int32((1 << cfg.bits) - 1)).astype(np.uint32)
            codes = np.frombuffer(_pack(offsets, cfg.bits + 1), dtype=np.uint8)
            return {"norms": norms, "codes": codes}
        if self.pattern is not None:
            return {"values": v[self.pattern]}
        sparse = topk_encode(v, cfg.k_for(v.size))
        return {"indices": sparse.indices, "values": sparse.values}

    def decode(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """The dense float32 delta; ValueError saying what is wrong with a bad payload."""
        if set(arrays) != set(self.names):
            raise ValueError(f"compressed update has arrays {sorted(arrays)}, expected "
                             f"{sorted(self.names)} ({self.config.kind})")
        cfg, dim = self.config, self.dim
        if cfg.kind == "qsgd":
            s, width = (1 << cfg.bits) - 1, cfg.bits + 1
            norms = _array(arrays, "norms", np.float32, self._buckets)
            codes = _array(arrays, "codes", np.uint8, math.ceil(dim * width / 8))
            _finite(norms, "norms")
            if np.any(norms < 0):
                raise ValueError("'norms' has negative values")
            offsets = _unpack(codes, width, dim)
            if dim and int(offsets.max()) > 2 * s:
                raise ValueError(f"QSGD level out of range: {int(offsets.max()) - s} > {s}")
            levels = offsets.astype(np.int32) - np.int32(s)
            return qsgd_dequantize(norms, levels, cfg.bits, cfg.bucket_size)
        k = cfg.k_for(dim)
        values = _array(arrays, "values", np.float32, k)
        _finite(values, "values")
        if self.pattern is not None:
            indices = self.pattern
        else:
            indices = _array(arrays, "indices", np.uint32, k)
            if k and (int(indices[-1]) >= dim or np.any(indices[1:] <= indices[:-1])):
                raise ValueError(f"top-k indices must be strictly increasing and < {dim}")
        out = np.zeros(dim, dtype=np.float32)
        out[indices] = values
        return out
