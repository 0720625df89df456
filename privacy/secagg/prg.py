"""Mask expansion: seed -> d words mod 2^bits, by AES-128-CTR from ``cryptography``.

The AES key is HKDF-SHA256(seed) (16 bytes); the counter starts at zero, which is
safe because every key expands exactly one mask. The keystream is read as
little-endian uint32 words (uint64 for bits > 32). Sums are computed with numpy's
wrap-around arithmetic in those words; reduction mod 2^bits (a bit mask) is done
once per chunk after all additions, which is exact because 2^bits divides 2^32 (2^64).

:func:`combine` walks the output in cache-sized chunks and, per chunk, adds every
input vector and expands every mask into one small reused buffer, so each mask
costs one AES pass and one in-cache add, with no full-size temporaries.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from privacy.secagg import workers
from privacy.secagg.keys import hkdf
from privacy.secagg.params import word_dtype

CHUNK_BYTES = 1 << 18
_ZERO_IV = bytes(16)
_AES_BLOCK = 16
_ZEROS = memoryview(bytes(CHUNK_BYTES))


def prg_key(seed: bytes) -> bytes:
    """The AES-128 key that expands ``seed``."""
    return hkdf(seed, b"fedring-secagg/prg/aes128-ctr", 16)


def _stream(key: bytes, block: int = 0) -> CipherContext:
    """The keystream of AES-128 ``key`` from 16-byte block ``block`` on (CTR can seek)."""
    iv = block.to_bytes(_AES_BLOCK, "big") if block else _ZERO_IV
    return Cipher(algorithms.AES(key), modes.CTR(iv)).encryptor()


def expand(seed: bytes, dim: int, bits: int) -> np.ndarray:
    """The mask of ``seed``: ``dim`` words mod 2^bits."""
    return combine([], [(seed, 1)], dim, bits)


class _Masker:
    """Adds sum(vectors) + sum(sign * PRG(seed)) to chunks of words, one chunk at a time.

    Every mask is one AES-CTR stream read in order, so chunks must come in order;
    each chunk costs one in-cache keystream pass and one add per mask (the first
    vector is added together with the first mask). An ``out`` of narrower words
    than the masks' (e.g. uint16 for bits <= 16) is computed in a word-sized chunk
    and narrowed: the values are below 2^bits, so nothing is lost.
    """

    def __init__(
        self, vectors: Sequence[np.ndarray], keys: Sequence[tuple[bytes, int]], bits: int,
        start: int = 0,
    ) -> None:
        """``keys``: (AES key, sign) per mask; chunks start at word ``start`` (a multiple of
        the words in an AES block)."""
        self.dtype = word_dtype(bits)
        self.step = CHUNK_BYTES // self.dtype.itemsize
        self.vectors = vectors
        block = start * self.dtype.itemsize // _AES_BLOCK
        self.streams = [(_stream(key, block), sign >= 0) for key, sign in keys]
        self.low = None if bits == 8 * self.dtype.itemsize else self.dtype.type((1 << bits) - 1)
        scratch = _scratch()
        self._keystream = scratch[0]
        self._mask = np.frombuffer(scratch[0], dtype=self.dtype, count=self.step)
        self._work = np.frombuffer(scratch[1], dtype=self.dtype, count=self.step)

    def apply(self, chunk: np.ndarray, start: int, *, accumulate: bool) -> None:
        """chunk = (chunk if accumulate else 0) + vectors + masks over [start, start+len)."""
        n = chunk.size
        stop = start + n
        work = chunk if chunk.dtype == self.dtype else self._work[:n]
        vectors, streams = list(self.vectors), list(self.streams)
        if accumulate:
            if work is not chunk:
                np.copyto(work, chunk)
        elif vectors and streams and _fits(vectors[0], self.dtype):
            enc, positive = streams.pop(0)  # first vector and first mask in one pass
            mask = self._next(enc, n)
            x = vectors.pop(0)[start:stop]
            (np.add if positive else np.subtract)(x, mask, out=work, casting="unsafe")
        elif vectors:
            np.copyto(work, vectors.pop(0)[start:stop], casting="unsafe")
        else:
            work.fill(0)
        for v in vectors:
            # same-dtype add: uint64 + int64 would promote to float64 and lose bits
            np.add(work, v[start:stop].astype(self.dtype, copy=False), out=work)
        for enc, positive in streams:
            mask = self._next(enc, n)
            (np.add if positive else np.subtract)(work, mask, out=work)
        if self.low is not None:
            np.bitwise_and(work, self.low, out=work)
        if work is not chunk:
            np.copyto(chunk, work, casting="unsafe")

    def _next(self, enc: CipherContext, n: int) -> np.ndarray:
        """The stream's next n words (in the scratch buffer, valid until the next call)."""
        enc.update_into(_ZEROS[: n * self.dtype.itemsize], self._keystream)
        return self._mask[:n]


def _fits(x: np.ndarray, dtype: np.dtype) -> bool:
    """Whether x's words widen into ``dtype`` words without changing value."""
    return x.dtype.kind == "u" and x.dtype.itemsize <= dtype.itemsize


_LOCAL = threading.local()


def _scratch() -> tuple[bytearray, bytearray]:
    """This thread's two chunk-sized buffers (keystream, narrowing), reused across calls:
    fresh ones would pay their page faults on every call."""
    scratch = getattr(_LOCAL, "scratch", None)
    if scratch is None:
        # update_into needs block-1 bytes of slack
        scratch = _LOCAL.scratch = (bytearray(CHUNK_BYTES + _AES_BLOCK - 1), bytearray(CHUNK_BYTES))
    return scratch


def combine(
    vectors: Sequence[np.ndarray],
    masks: Sequence[tuple[bytes, int]],
    dim: int,
    bits: int,
    out: np.ndarray | None = None,
    *,
    accumulate: bool = False,
    threads: int = 1,
) -> np.ndarray:
    """sum(vectors) + sum(sign * PRG(seed) for seed, sign in masks) mod 2^bits.

    Vectors may have any integer dtype (values are taken mod 2^bits; each chunk
    is cast to the word dtype, wrapping, before it is added). The result
    is a little-endian uint32 (bits <= 32) or uint64 array: ``out`` if given (e.g.
    a view into a message buffer; it may also have narrower unsigned words that hold
    2^bits, such as uint16 for bits <= 16), else a new one. With ``accumulate`` the sum
    is added to what ``out`` holds (taken mod 2^bits), in place.

    With ``threads`` > 1 and enough work, up to that many threads claim chunks of the
    words (:func:`privacy.secagg.workers.share`: each walks a contiguous range, and one
    that runs out takes over the back half of another's rest; AES-CTR seeks to a range's
    first block; ``cryptography`` and numpy release the GIL), so the result is the same
    however the chunks fall; the CPU time those threads spend is added to the caller's
    :func:`privacy.secagg.workers.worker_cpu_seconds`.
    """
    dtype = word_dtype(bits)
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        out = np.empty(dim, dtype=dtype)
    elif (
        out.shape != (dim,)
        or not out.flags.c_contiguous
        or not (out.dtype == dtype or (out.dtype.kind == "u" and bits <= 8 * out.dtype.itemsize
                                       and out.dtype.itemsize < dtype.itemsize))
    ):
        raise ValueError(f"out must be a contiguous array of {dim} {dtype} words")
    keys = [(prg_key(seed), sign) for seed, sign in masks]
    if dim * max(1, len(keys)) < PARALLEL_WORDS:
        threads = 1
    step = CHUNK_BYTES // dtype.itemsize
    workers.share(dim, step, threads,
                  functools.partial(_fill, vectors, keys, bits, out, accumulate))
    return out


PARALLEL_WORDS = 1 << 21  # words of masks below which one thread does it all


def _fill(vectors: Sequence[np.ndarray], keys: Sequence[tuple[bytes, int]], bits: int,
          out: np.ndarray, accumulate: bool, chunks: Iterator[tuple[int, int]]) -> None:
    """One thread's chunks of :func:`combine`: the streams go on from chunk to chunk and
    start again (seeking) where the thread took over another thread's rest."""
    masker, at = None, -1
    for start, stop in chunks:
        if start != at:
            masker = _Masker(vectors, keys, bits, start=start)
        masker.apply(out[start:stop], start, accumulate=accumulate)  # type: ignore[union-attr]
        at = stop


def prg_bound(dim: int, masks: int, reps: int = 3) -> float:
    """The PRG cost floor a masking client cannot beat: best CPU time (of ``reps``) to
    expand ``masks`` AES-128-CTR masks of ``dim`` uint32 words and add them up."""
    if masks == 0:
        return 0.0
    zeros, out = bytes(4 * dim), bytearray(4 * dim + 15)
    acc = np.zeros(dim, np.uint32)
    view = np.frombuffer(out, np.uint32, count=dim)
    best = float("inf")
    for _ in range(reps):
        started = time.thread_time()
        for _ in range(masks):
            enc = Cipher(algorithms.AES(os.urandom(16)), modes.CTR(bytes(16))).encryptor()
            enc.update_into(zeros, out)
            np.add(acc, view, out=acc)
        best = min(best, time.thread_time() - started)
    return best
