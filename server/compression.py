"""Server side of ``[compression]``: check it against the rest of the scenario, ask the
clients of a round to compress, and know how to decode what they send.

Without secure aggregation the clients encode their delta (``client.compression``) and
``server.replies`` decodes it with the round's :class:`RoundCodec` before the pipeline's
Validate stage. With secure aggregation the server sees only a masked sum, so:

- ``kind = "qsgd"`` is carried out by the secure path's own fixed-point quantizer,
  which is QSGD's unbiased stochastic rounding with one scale shared by every client
  (``secagg.clip_range``) in place of a norm per client, because masked integer sums add
  up only under a common scale. The scenario resolves ``secagg.rounding = "stochastic"``
  and ``secagg.bits`` to the smallest modulus that gives each client at least
  ``2^compression.bits`` levels for a round's clients; the secure path keeps at least 8
  bits, so ``compression.bits`` must be >= 8 there. With central DP each client clips
  below C by the rounding's worst case (``server.secure_aggregation.central_dp_clip``), which
  fails at start, naming ``compression.bits``, when a model is too large for the levels.
- ``kind = "topk"`` with ``shared_pattern = true`` (rand-k on a pattern derived from run
  and round) lines up: every client of a secure round (or of a secure FedBuff buffer)
  masks only the round's ``k`` values plus its weight, so SecAgg+ sums ``k + 1`` words
  instead of ``d + 1``, and the server scatters the unmasked sum back into the ``d``
  coordinates (:class:`SharedPattern`). Plain top-k is refused: each client would keep
  other coordinates, so masks and values would not line up in the sum. Distributed DP
  plans its own encoding of the whole vector and is refused with it.

Without secure aggregation both drivers compress: sync rounds and the async drivers
(FedBuff, FedAsync), which decode each reply with the codec of the round it was sent in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregation.compression import CompressionConfig, RoundCodec
from client.protocol.compression import CompressionRequest

SECURE_MIN_BITS = 8  # the secure path's least resolution per coordinate (MIN_LEVEL_BITS)


def compression_config(config: Mapping[str, Any]) -> CompressionConfig:
    return CompressionConfig(**dict(config.get("compression") or {}))


def session_number(run_id: str) -> int:
    """A 63-bit number naming a store run for compression (seeds the shared pattern,
    binds residuals). Not the SecAgg+ protocol run id (``server.secagg_session.session_id``):
    it hashes the run id under its own label, so the two differ for every run."""
    return int.from_bytes(hashlib.sha256(f"compression:{run_id}".encode()).digest()[:8],
                          "little") >> 1


class ReplyCompression:
    """What a driver needs to have its clients compress their replies in plain rounds."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config

    @classmethod
    def of(cls, config: CompressionConfig, *, secure: bool) -> ReplyCompression | None:
        """None when clients upload dense deltas (no compression, or secagg's own path)."""
        return cls(config) if config.enabled and not secure else None

    def request(self, run_id: str) -> str:
        """The train config entry (``client.protocol.keys.ConfigKey.COMPRESSION``) of a run."""
        return CompressionRequest(self.config, session_number(run_id)).to_json()

    def codec(self, run_id: str, rnd: int, dim: int) -> RoundCodec:
        return RoundCodec.for_round(self.config, dim, run=session_number(run_id), rnd=rnd)


@dataclass(frozen=True)
class RoundPattern:
    """One secure round's shared pattern: the request the clients get in their SETUP
    record, and the sorted coordinates whose sum the round unmasks."""

    request: str
    indices: np.ndarray  # uint32, sorted

    def scatter(self, values: np.ndarray, dim: int) -> np.ndarray:
        """The ``dim`` coordinates of the pattern's ``values`` (zero elsewhere)."""
        out = np.zeros(dim, dtype=values.dtype)
        out[self.indices] = values
        return out


class SharedPattern:
    """Top-k on a shared pattern under secure aggregation (see the module's docstring)."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config

    @classmethod
    def of(cls, config: CompressionConfig, *, secure: bool) -> SharedPattern | None:
        """None unless secagg is on and clients send top-k on a shared pattern."""
        return cls(config) if secure and config.kind == "topk" and config.shared_pattern \
            else None

    def for_round(self, run_id: str, rnd: int, dim: int) -> RoundPattern:
        request = CompressionRequest(self.config, session_number(run_id))
        pattern = request.codec(dim, rnd).pattern
        assert pattern is not None
        return RoundPattern(request.to_json(), pattern)
