"""The ``[secagg]`` scenario section: secure aggregation (SecAgg+) of each sync round, or
of each FedBuff buffer (``driver.kind = "fedbuff"``: ``server.secure_buffer``).

With ``enabled = true`` every sampled client masks its clipped, weighted, quantized
delta, and the server learns only the sum over the round's survivors (see
``server.secure_round`` and ``client.secure_client``). Keys:

- ``neighbors``: "auto" (the smallest degree k that keeps the failure and leak
  probabilities below 2^-20 and 2^-40, ``privacy.secagg.default_k``), "full" (k = n-1:
  SecAgg of Bonawitz et al.) or an integer k (raised by one when n*k is odd, at most n-1);
- ``threshold``: a fraction f in (0, 1) (t = floor(f*k) + 1, a strict majority at 0.5)
  or an integer count t <= k;
- ``bits``: the modulus 2^bits of the masked sums; ``clip_range``: each coordinate of
  a delta is clipped to [-clip_range, clip_range]; ``max_weight``: a client's weight is
  min(num_examples, max_weight) (1 with ``aggregation.weight_by = "uniform"``);
  ``scale``: fixed-point scale, 0 for the largest power of two that cannot wrap;
  ``rounding``: "nearest" or "stochastic" (unbiased);
- ``dropout`` (simulations): each participating client vanishes with this probability,
  at ``dropout_stage`` ("random", or advertise_keys, share_keys, masked_input or
  unmasking), decided by ``client.secure_client.dropout_stage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from client.secure_client import STAGE_NAMES
from privacy.secagg import check_headroom, default_k, default_threshold, max_scale
from privacy.secagg.quantize import max_level
from server.driver_config import FEDASYNC_SECAGG

ROUNDINGS = ("nearest", "stochastic")
MIN_LEVEL_BITS = 8  # a client's coordinate must keep at least this many bits of resolution
DEFAULT_THRESHOLD = 0.5
PLANNED_DROPOUT = 0.1  # the dropout rate "auto" plans for, unless ``dropout`` is higher


@dataclass(frozen=True)
class SecAggScenarioConfig:
    """``[secagg]``; ``neighbors`` and ``threshold`` None mean "auto" and 0.5."""

    enabled: bool = False
    neighbors: Any = None
    threshold: Any = None
    bits: int = 32
    clip_range: float = 1.0
    max_weight: float = 1000.0
    scale: float = 0.0
    rounding: str = "nearest"
    dropout: float = 0.0
    dropout_stage: str = "random"

    def __post_init__(self) -> None:
        k, t = self.neighbors, self.threshold
        if k is None:
            object.__setattr__(self, "neighbors", "auto")
        elif isinstance(k, bool) or not (k in ("auto", "full")
                                         or (isinstance(k, int) and k >= 1)):
            raise ValueError(f"secagg.neighbors must be 'auto', 'full' or an integer k >= 1, "
                             f"got {k!r}")
        if t is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLD)
        elif isinstance(t, bool) or not ((isinstance(t, float) and 0 < t < 1)
                                         or (isinstance(t, int) and t >= 1)):
            raise ValueError(f"secagg.threshold must be a fraction in (0, 1) or an integer "
                             f"count >= 1, got {t!r}")
        if not 8 <= self.bits <= 64:
            raise ValueError(f"secagg.bits must be in [8, 64], got {self.bits}")
        if not self.clip_range > 0 or not self.max_weight > 0 or not self.scale >= 0:
            raise ValueError("secagg.clip_range and secagg.max_weight must be > 0, and "
                             "secagg.scale >= 0 (0: the largest that cannot wrap)")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"secagg.rounding must be one of {', '.join(ROUNDINGS)}, "
                             f"got '{self.rounding}'")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"secagg.dropout must be in [0, 1), got {self.dropout}")
        if self.dropout_stage not in ("random", *STAGE_NAMES):
            raise ValueError(f"secagg.dropout_stage must be 'random' or one of "
                             f"{', '.join(STAGE_NAMES)}, got '{self.dropout_stage}'")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SecAggScenarioConfig:
        return cls(**dict(values or {}))

    def weight_cap(self, weight_by: str) -> float:
        """The largest client weight: ``max_weight``, or 1 for uniform weights."""
        return 1.0 if weight_by == "uniform" else float(self.max_weight)

    def graph(self, n: int) -> tuple[int, int]:
        """(k, t) for a round with ``n`` participants; ValueError if none fits."""
        if n < 2:
            raise ValueError(f"secure aggregation needs at least 2 participants, got {n}")
        t_count = self.threshold if isinstance(self.threshold, int) else None
        fraction = DEFAULT_THRESHOLD if t_count is not None else float(self.threshold)
        if self.neighbors == "full":
            k = n - 1
        elif self.neighbors == "auto":
            k = default_k(n, dropout_fraction=max(PLANNED_DROPOUT, self.dropout),
                          threshold_fraction=fraction)
            k = max(k, t_count or 1)
        else:
            k = max(int(self.neighbors), t_count or 1)
        k = min(k, n - 1)
        if (n * k) % 2:
            k += 1  # a k-regular graph on n nodes needs n*k even; k = n-1 never gets here
        t = t_count if t_count is not None else default_threshold(k, fraction)
        if t > k:
            raise ValueError(f"secagg.threshold = {t} exceeds the {k} neighbours a client has "
                             f"among {n} participants")
        return k, t

    def scale_for(self, n: int, weight_by: str) -> float:
        """The fixed-point scale of a round with ``n`` participants (checked for wrap)."""
        cap = self.weight_cap(weight_by)
        if self.scale > 0:
            check_headroom(n, self.bits, self.clip_range, cap, scale=self.scale)
            return float(self.scale)
        return max_scale(n, self.bits, self.clip_range, cap)


def check_secagg(config: Mapping[str, Any]) -> SecAggScenarioConfig | None:
    """The ``[secagg]`` settings if enabled (else None); ValueError for what cannot run."""
    cfg = SecAggScenarioConfig.from_dict(config.get("secagg"))
    if not cfg.enabled:
        return None
    agg = config["aggregation"]
    if agg["combine"] not in ("mean", "sum"):
        raise ValueError(f"secagg is on, so the server only ever sees the weighted sum of the "
                         f"updates, never one update: aggregation.combine = "
                         f"'{agg['combine']}' needs each update and cannot run on a sum; use "
                         "'mean' or 'sum', or turn secagg off")
    if agg.get("max_norm", 0):
        raise ValueError("secagg is on, so the server cannot see an update to check its norm: "
                         "set aggregation.max_norm = 0 (secagg.clip_range bounds each "
                         "coordinate instead)")
    mode = dict(config.get("dp", {})).get("mode", "off")
    if mode == "local":
        raise ValueError("dp.mode = 'local' together with secagg is not supported: use "
                         "dp.mode = 'distributed' (each client adds integer noise under the "
                         "masks) or 'central' (clients clip, the server noises the sum)")
    driver = dict(config.get("driver", {}))
    kind = driver.get("kind", "sync")
    if kind == "fedasync":
        raise ValueError(FEDASYNC_SECAGG)
    if kind not in ("sync", "fedbuff", "cross_silo") or \
            driver.get("late_policy", "drop") != "drop":
        raise ValueError(f"secagg runs in synchronous rounds that drop late clients or in "
                         f"FedBuff's buffers; driver.kind = '{kind}' with driver.late_policy "
                         f"= '{driver.get('late_policy')}' is not supported with it")
    if dict(config.get("clients", {})).get("offline_fraction", 0):
        raise ValueError("secagg does not simulate clients going offline through "
                         "clients.offline_fraction; set it to 0 and use secagg.dropout")
    n = max_round_size(config)
    if kind == "fedbuff" and n < 2:  # one secure sum per buffer of buffer_size updates
        raise ValueError(f"secure FedBuff sums each buffer under secagg, which needs at "
                         f"least 2 updates: raise driver.buffer_size (got {n}) to >= 2")
    if n < 2:
        raise ValueError(f"secagg needs at least 2 clients per round, the federation samples "
                         f"{n}")
    cfg.graph(n)  # e.g. a threshold count above k
    if mode == "distributed":  # no fixed-point encoding: the DP plan checks the headroom
        return cfg
    cap = cfg.weight_cap(agg["weight_by"])
    try:
        scale = cfg.scale_for(n, agg["weight_by"])
    except ValueError as exc:
        raise ValueError(f"secagg: the masked sum could wrap around 2^{cfg.bits}: {exc}") \
            from None
    level = max_level(cfg.clip_range, scale, cap)
    if level < 1 << MIN_LEVEL_BITS:
        need = next((b for b in range(cfg.bits + 1, 65) if max_level(
            cfg.clip_range, max_scale(n, b, cfg.clip_range, cap), cap) >= 1 << MIN_LEVEL_BITS),
            64)
        raise ValueError(f"secagg.bits = {cfg.bits} leaves {level} quantization levels per "
                         f"coordinate for {n} clients (fewer than 2^{MIN_LEVEL_BITS}): raise "
                         f"secagg.bits to >= {need}")
    return cfg


def max_round_size(config: Mapping[str, Any]) -> int:
    """The most clients one secure sum can hold: the clients sampled per round (all of
    them under Poisson sampling), or FedBuff's ``buffer_size``."""
    driver = dict(config.get("driver", {}))
    if driver.get("kind", "sync") == "fedbuff":
        return int(driver.get("buffer_size", 10))
    fed = config["federation"]
    n = int(fed["clients"])
    if fed.get("sampling", "fixed") == "fixed":
        n = min(n, max(int(fed["min_clients"]), round(fed["sample_fraction"] * n)))
    return n
