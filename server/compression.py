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
  bits, so ``compression.bits`` must be >= 8 there.
- ``kind = "topk"`` is refused: each client would keep different coordinates, so masks
  and values would not line up in the sum; a shared pattern (rand-k on a pattern derived
  from run and round) would line up, but the secure round does not route it yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from aggregation.compression import CompressionConfig, RoundCodec
from client.compression import CompressionRequest
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
    if not secure and driver.get("kind", "sync") != "sync":
        raise ValueError(f"compression.kind = '{cfg.kind}' runs in synchronous rounds: "
                         f"driver.kind = '{driver.get('kind')}' does not ask its clients to "
                         "compress yet; use driver.kind = 'sync' or compression.kind = 'none'")
    if cfg.shared_pattern and driver.get("late_policy", "drop") == "carry":
        raise ValueError("compression.shared_pattern ties the coordinates to one round, so a "
                         "late update carried into the next round would not line up: set "
                         "driver.late_policy = 'drop'")
    if not secure:
        return
    if cfg.kind == "topk":
        if not cfg.shared_pattern:
            raise ValueError("compression.kind = 'topk' with secagg: each client keeps other "
                             "coordinates, so the masked sum cannot line up; use "
                             "compression.kind = 'qsgd' (it composes with secagg)")
        raise ValueError("compression.shared_pattern with secagg: the secure round does not "
                         "sum a shared coordinate pattern yet; use compression.kind = 'qsgd' "
                         "with secagg, or shared_pattern without secagg")
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
    def from_config(cls, config: Mapping[str, Any]) -> ReplyCompression | None:
        """None when clients upload dense deltas (no compression, or secagg's own path)."""
        cfg = compression_config(config)
        if not cfg.enabled or config.get("secagg", {}).get("enabled", False):
            return None
        return cls(cfg)

    def request(self, run_id: str) -> str:
        """The train config entry (``client.compression.COMPRESSION_KEY``) of a run."""
        return CompressionRequest(self.config, session_number(run_id)).to_json()

    def codec(self, run_id: str, rnd: int, dim: int) -> RoundCodec:
        return RoundCodec.for_round(self.config, dim, run=session_number(run_id), rnd=rnd)
