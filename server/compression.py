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
  below C by the rounding's worst case (``server.secure_round.central_dp_clip``), which
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
from privacy.secagg import max_scale
from privacy.secagg.quantize import max_level
from server.secagg_config import SecAggScenarioConfig, max_round_size

SECURE_MIN_BITS = 8  # the secure path's least resolution per coordinate (MIN_LEVEL_BITS)


def compression_config(config: Mapping[str, Any]) -> CompressionConfig:
    return CompressionConfig(**dict(config.get("compression") or {}))


def check_compression(config: dict[str, Any], raw_secagg: Mapping[str, Any]) -> None:
    """Refuse combinations that cannot work; with secagg and QSGD, resolve ``[secagg]``'s
    ``bits`` and ``rounding`` in ``config`` (``raw_secagg``: the keys the user set)."""
    cfg = compression_config(config)
    if not cfg.enabled:
        return
    secure = bool(config.get("secagg", {}).get("enabled", False))
    driver = dict(config.get("driver", {}))
    if driver.get("kind", "sync") == "cross_silo":
        return  # the cross-silo check refuses it with its own message
    if cfg.shared_pattern and driver.get("late_policy", "drop") == "carry":
        raise ValueError("compression.shared_pattern ties the coordinates to one round, so a "
                         "late update carried into the next round would not line up: set "
                         "driver.late_policy = 'drop'")
    if not secure:
        return
    if cfg.kind == "topk":
        if not cfg.shared_pattern:
            raise ValueError("compression.kind = 'topk' with secagg: each client keeps other "
                             "coordinates, so the masked sum cannot line up; set "
                             "compression.shared_pattern = true (every client sends the same "
                             "coordinates) or use compression.kind = 'qsgd'")
        if dict(config.get("dp", {})).get("mode", "off") == "distributed":
            raise ValueError("compression.shared_pattern with dp.mode = 'distributed': "
                             "distributed DP encodes the whole vector; set compression.kind = "
                             "'none' or dp.mode = 'central'")
        return
    _resolve_secure_qsgd(config, cfg, raw_secagg)


def _resolve_secure_qsgd(config: dict[str, Any], cfg: CompressionConfig,
                         raw_secagg: Mapping[str, Any]) -> None:
    """Secure QSGD: stochastic rounding and the smallest modulus for ``cfg.bits`` levels."""
    mode = dict(config.get("dp", {})).get("mode", "off")
    if mode == "distributed":
        raise ValueError("compression.kind = 'qsgd' with dp.mode = 'distributed': distributed "
                         "DP picks its own integer encoding; set compression.kind = 'none'")
    if cfg.bits < SECURE_MIN_BITS:
        raise ValueError(f"compression.bits = {cfg.bits} with secagg: the secure sum keeps at "
                         f"least {SECURE_MIN_BITS} bits per coordinate; set compression.bits "
                         f">= {SECURE_MIN_BITS}, or turn secagg off")
    for key in ("bits", "scale"):
        if key in raw_secagg:
            raise ValueError(f"compression.kind = 'qsgd' with secagg sets secagg.{key} from "
                             f"compression.bits: drop secagg.{key}")
    if raw_secagg.get("rounding", "stochastic") != "stochastic":
        raise ValueError("compression.kind = 'qsgd' rounds stochastically (unbiased): drop "
                         "secagg.rounding = 'nearest'")
    secagg = config["secagg"]
    settings = SecAggScenarioConfig.from_dict(secagg)
    n = max(2, max_round_size(config))
    cap = settings.weight_cap(config["aggregation"]["weight_by"])
    c = settings.clip_range
    need = next((b for b in range(SECURE_MIN_BITS, 65)
                 if max_level(c, max_scale(n, b, c, cap), cap) >= 1 << cfg.bits), None)
    if need is None:
        raise ValueError(f"compression.bits = {cfg.bits}: no secagg modulus up to 2^64 gives "
                         f"{n} clients that many levels; lower compression.bits")
    secagg.update(bits=need, rounding="stochastic")


def session_number(run_id: str) -> int:
    """A 63-bit number naming a store run (seeds the shared pattern, binds residuals)."""
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
