"""The ``[secagg]`` scenario section: secure aggregation (SecAgg+) of each sync round, or
of each FedBuff buffer (``driver.kind = "fedbuff"``: ``server.secure_buffer``).

With ``enabled = true`` every sampled client masks its clipped, weighted, quantized
delta, and the server learns only the sum over the round's survivors (see
``server.secagg_session`` and ``client.secure_client``). Keys:

- ``neighbors``: "auto" (the smallest degree k that keeps the failure and leak
  probabilities below 2^-20 and 2^-40, ``privacy.secagg.default_k``, at least 3), "full"
  (k = n-1: SecAgg of Bonawitz et al.) or an integer k >= 3 (raised by one when n*k is
  odd, at most n-1);
- ``threshold``: a fraction f in [0.5, 1) (t = floor(f*k) + 1, a strict majority) or an
  integer count t with k/2 < t <= k;
- ``min_survivors`` (>= 3, default 3): no sum of fewer clients is ever revealed; the
  round aborts before any unmasking share is requested;
- ``corrupt_fraction`` (default 0.05, ``privacy.secagg.policy``): the fraction of
  clients assumed to collude with the server when "auto" picks k; an explicit k (or t)
  that exposes more clients than Bell et al.'s bound allows, and more than "auto" would,
  is warned about at start (:func:`exposure_warning`);
- ``bits``: the modulus 2^bits of the masked sums; ``clip_range``: each coordinate of
  a delta is clipped to [-clip_range, clip_range]: "auto" (the default) sets each
  round's range from public figures only (``server.secure_range``: the DP clip under
  central DP, else the previous round's aggregate times a margin, from
  :data:`AUTO_START_RANGE` in the first round), a number fixes it; clients count what
  they clip, and the round records the total (``secagg_clipped``);
  ``max_weight``: a client's weight is min(num_examples, max_weight) (1 with
  ``aggregation.weight_by = "uniform"``), and its examples count towards the round's
  training-loss total up to max_weight;
  ``scale``: fixed-point scale, 0 for the largest power of two that cannot wrap;
  ``rounding``: "nearest" or "stochastic" (unbiased);
- ``dropout`` (simulations): this fraction of the federation's clients vanishes in each
  round (rounded at random to a whole number, so ``dropout * clients`` on average; each
  client independently with this probability where a node does not know how many
  partitions there are), at ``dropout_stage`` ("random", or advertise_keys, share_keys,
  masked_input or unmasking), decided by ``client.protocol.secagg.dropout_stage``;
- ``security``: "semi_honest" (the default: against an honest-but-curious server) or
  "malicious" (against a server that lies: signed key advertisements, a graph derived
  from them, a consistency check before unmasking, ``privacy.secagg.malicious``); every
  client then needs a SecAgg+ identity (``client.secagg_identity``);
- ``advertise_ahead`` (default true): in sync rounds each client's last reply also
  advertises its keys for the next round, and a round whose whole cohort did so sends
  SETUP with the public keys (one exchange fewer, ``privacy.secagg.ahead``); false gives
  the flow without it;
- ``presign`` (default true; only with ``security = "malicious"`` and ``advertise_ahead``):
  in a round whose keys came ahead each client signs the survivor set (the whole
  advertisement list) with its masked input, so the consistency check's exchange is
  skipped (two exchanges, as semi-honest); a client that drops after the training
  instruction then costs that round (it aborts, nothing released). False gives the flow
  without it.

The settings can only be as strict as ``privacy.secagg.policy`` or stricter: weaker
ones fail at start naming the key and its minimum, and every client checks the session
it is sent against its own policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from client.protocol.secagg import STAGE_NAMES
from privacy.secagg import check_headroom, default_k, default_threshold, max_scale
from privacy.secagg.params import (
    DEFAULT_CORRUPT_FRACTION,
    MIN_NEIGHBORS,
    MIN_SURVIVORS,
    SECURITY_BITS,
    SECURITY_MODES,
    exposed_fraction,
    meets_security,
)
from privacy.secagg.policy import SecAggPolicy
from server.config import FederationConfig
from server.driver_config import DriverConfig

ROUNDINGS = ("nearest", "stochastic")
MIN_LEVEL_BITS = 8  # a client's coordinate must keep at least this many bits of resolution
DEFAULT_THRESHOLD = 0.5
PLANNED_DROPOUT = 0.1  # the dropout rate "auto" plans for, unless ``dropout`` is higher
AUTO_START_RANGE = 1024.0  # clip_range = "auto": the first round's range, before any aggregate


@dataclass(frozen=True)
class SecAggScenarioConfig:
    """``[secagg]``; ``neighbors``, ``threshold`` and ``clip_range`` None mean "auto", 0.5
    and "auto"."""

    enabled: bool = False
    neighbors: Any = None
    threshold: Any = None
    bits: int = 32
    clip_range: Any = None  # None: "auto"
    max_weight: float = 1000.0
    scale: float = 0.0
    rounding: str = "nearest"
    dropout: float = 0.0
    dropout_stage: str = "random"
    min_survivors: int = MIN_SURVIVORS
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION
    security: str = "semi_honest"
    advertise_ahead: bool = True
    presign: bool = True

    def __post_init__(self) -> None:
        k, t = self.neighbors, self.threshold
        if k is None:
            object.__setattr__(self, "neighbors", "auto")
        elif isinstance(k, bool) or not (k in ("auto", "full") or isinstance(k, int)):
            raise ValueError(f"secagg.neighbors must be 'auto', 'full' or an integer k >= "
                             f"{MIN_NEIGHBORS}, got {k!r}")
        elif isinstance(k, int) and k < MIN_NEIGHBORS:
            raise ValueError(f"secagg.neighbors = {k} is below the minimum {MIN_NEIGHBORS}: "
                             "with fewer neighbours the server can rebuild small groups' sums "
                             "(k = 1 pairs the clients, k = 2 makes cycles); set "
                             f"secagg.neighbors >= {MIN_NEIGHBORS}, 'auto' or 'full'")
        if t is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLD)
        elif isinstance(t, bool) or not (isinstance(t, float | int) and t > 0) or \
                (isinstance(t, float) and t >= 1):
            raise ValueError(f"secagg.threshold must be a fraction in [{DEFAULT_THRESHOLD}, 1) "
                             f"or an integer count >= 2, got {t!r}")
        elif isinstance(t, float) and t < DEFAULT_THRESHOLD:
            raise ValueError(f"secagg.threshold = {t} is below the minimum fraction "
                             f"{DEFAULT_THRESHOLD}: t = floor({t}*k) + 1 is then at most half "
                             "of the k neighbours for some k, and two disjoint groups of "
                             "neighbours could each rebuild a secret; set secagg.threshold "
                             f"to a fraction in [{DEFAULT_THRESHOLD}, 1)")
        elif isinstance(t, int) and t < 2:
            raise ValueError(f"secagg.threshold = {t} is below the minimum 2 (and must be more "
                             "than half of the neighbours k): with t = 1 each share is the "
                             "secret itself; set secagg.threshold >= 2 or a fraction >= "
                             f"{DEFAULT_THRESHOLD}")
        m = self.min_survivors
        if isinstance(m, bool) or not isinstance(m, int) or m < MIN_SURVIVORS:
            raise ValueError(f"secagg.min_survivors = {m!r} is below the minimum "
                             f"{MIN_SURVIVORS}: a sum of fewer clients exposes too much of "
                             f"each; set secagg.min_survivors to an integer >= {MIN_SURVIVORS}")
        cf = self.corrupt_fraction
        if isinstance(cf, bool) or not isinstance(cf, float | int) or not 0 < cf < 1:
            raise ValueError(f"secagg.corrupt_fraction must be in (0, 1) (the fraction of "
                             f"clients assumed to collude with the server; default "
                             f"{DEFAULT_CORRUPT_FRACTION}), got {cf!r}")
        if not 8 <= self.bits <= 64:
            raise ValueError(f"secagg.bits must be in [8, 64], got {self.bits}")
        if self.clip_range is None:
            object.__setattr__(self, "clip_range", "auto")
        c = self.clip_range
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int | float) or
                            not c > 0):
            raise ValueError(f"secagg.clip_range must be \"auto\" (each round's range from "
                             f"the previous aggregate) or a number > 0, got {c!r}")
        if not self.max_weight > 0 or not self.scale >= 0:
            raise ValueError("secagg.max_weight must be > 0, and "
                             "secagg.scale >= 0 (0: the largest that cannot wrap)")
        if c == "auto" and self.scale > 0:
            raise ValueError(f"secagg.scale = {self.scale:g} with secagg.clip_range = \"auto\": "
                             "the range changes from round to round and the scale must follow "
                             "it so that the sum cannot wrap; set secagg.scale = 0, or a fixed "
                             "secagg.clip_range")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"secagg.rounding must be one of {', '.join(ROUNDINGS)}, "
                             f"got '{self.rounding}'")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"secagg.dropout must be in [0, 1), got {self.dropout}")
        if self.dropout_stage not in ("random", *STAGE_NAMES):
            raise ValueError(f"secagg.dropout_stage must be 'random' or one of "
                             f"{', '.join(STAGE_NAMES)}, got '{self.dropout_stage}'")
        if self.security not in SECURITY_MODES:
            raise ValueError(f"secagg.security must be one of {', '.join(SECURITY_MODES)} "
                             f"(\"malicious\": against a server that lies), "
                             f"got {self.security!r}")

        if not isinstance(self.advertise_ahead, bool):
            raise ValueError(f"secagg.advertise_ahead must be true or false (true: each "
                             f"round's keys advertised with the previous round's last reply, "
                             f"one exchange fewer), got {self.advertise_ahead!r}")
        if not isinstance(self.presign, bool):
            raise ValueError(f"secagg.presign must be true or false (true: in a malicious "
                             f"round with keys advertised ahead, each client signs the "
                             f"survivor set with its masked input, one exchange fewer), "
                             f"got {self.presign!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SecAggScenarioConfig:
        return cls(**dict(values or {}))

    @property
    def auto_range(self) -> bool:
        """Whether each round picks its own clip range (``clip_range = "auto"``)."""
        return self.clip_range == "auto"

    @property
    def start_range(self) -> float:
        """The fixed clip range, or the first round's under "auto"."""
        return AUTO_START_RANGE if self.auto_range else float(self.clip_range)

    def with_range(self, clip_range: float) -> SecAggScenarioConfig:
        """These settings with a fixed clip range (one round's)."""
        return replace(self, clip_range=float(clip_range))

    def weight_cap(self, weight_by: str) -> float:
        """The largest client weight: ``max_weight``, or 1 for uniform weights."""
        return 1.0 if weight_by == "uniform" else float(self.max_weight)

    @property
    def policy(self) -> SecAggPolicy:
        """The policy the server's sessions meet (clients check their own)."""
        return SecAggPolicy(min_survivors=self.min_survivors,
                            corrupt_fraction=float(self.corrupt_fraction))

    def graph(self, n: int) -> tuple[int, int]:
        """(k, t) for a round with ``n`` participants; ValueError if none fits."""
        if n < self.min_survivors:
            raise ValueError(f"secure aggregation needs at least secagg.min_survivors = "
                             f"{self.min_survivors} participants per round, got {n}")
        t_count = self.threshold if isinstance(self.threshold, int) else None
        fraction = DEFAULT_THRESHOLD if t_count is not None else float(self.threshold)
        if self.neighbors == "full":
            k = n - 1
        elif self.neighbors == "auto":
            k = default_k(n, dropout_fraction=max(PLANNED_DROPOUT, self.dropout),
                          corrupt_fraction=float(self.corrupt_fraction),
                          threshold_fraction=fraction)
            k = max(k, t_count or 1, MIN_NEIGHBORS)
        else:
            k = max(int(self.neighbors), t_count or 1)
        k = min(k, n - 1)
        if (n * k) % 2:
            k += 1  # a k-regular graph on n nodes needs n*k even; k = n-1 never gets here
        t = t_count if t_count is not None else default_threshold(k, fraction)
        if t > k:
            raise ValueError(f"secagg.threshold = {t} exceeds the {k} neighbours a client has "
                             f"among {n} participants")
        if 2 * t <= k:
            raise ValueError(f"secagg.threshold = {t} is not more than half of the {k} "
                             f"neighbours a client has among {n} participants: set it to at "
                             f"least {k // 2 + 1}, or to a fraction >= {DEFAULT_THRESHOLD}")
        return k, t

    def exposure_warning(self, n: int) -> str | None:
        """Why the (k, t) of a round of ``n`` clients falls short of Bell et al.'s bound for
        ``corrupt_fraction`` (:func:`privacy.secagg.params.meets_security`) and exposes
        more clients than "auto" would; None when it does not."""
        k, t = self.graph(n)
        gamma = float(self.corrupt_fraction)
        if meets_security(n, k, t, gamma):
            return None
        auto_k, auto_t = replace(self, neighbors="auto", threshold=DEFAULT_THRESHOLD).graph(n)
        p = exposed_fraction(k, t, gamma)
        if p <= exposed_fraction(auto_k, auto_t, gamma):
            return None  # e.g. a small cohort: even the full graph misses the bound
        keys = [f"secagg.neighbors = {self.neighbors!r}"]
        if self.threshold != DEFAULT_THRESHOLD:
            keys.append(f"secagg.threshold = {self.threshold!r}")
        verb, auto = ("give", " and the default threshold") if len(keys) > 1 else ("gives", "")
        return (f"WARNING: {' and '.join(keys)} {verb} k = {k}, t = {t} at {n} clients a "
                f"round, short of Bell et al.'s bound for secagg.corrupt_fraction = {gamma:g}: "
                f"{100 * p:.3g}% of a round's clients are expected to have t or more corrupt "
                f"neighbours (who, with the server, can unmask their inputs), so a chance of up "
                f"to {min(1.0, n * p):.3g} that some client of the {n} has, against a target of "
                f"2^-{SECURITY_BITS} = {2.0**-SECURITY_BITS:.3g}; raise "
                f"{' or '.join(key.split(' =')[0] for key in keys)}, or set "
                f"secagg.neighbors = \"auto\"{auto} (k = {auto_k}, t = {auto_t} here)")

    def scale_for(self, n: int, weight_by: str) -> float:
        """The fixed-point scale of a round with ``n`` participants (checked for wrap)."""
        cap = self.weight_cap(weight_by)
        if self.scale > 0:
            check_headroom(n, self.bits, self.start_range, cap, scale=self.scale)
            return float(self.scale)
        return max_scale(n, self.bits, self.start_range, cap)


def max_round_size(config: Mapping[str, Any]) -> int:
    """The most clients one secure sum can hold: the most clients per round, or FedBuff's
    ``buffer_size``."""
    driver = DriverConfig(**dict(config.get("driver") or {}))
    if driver.kind == "fedbuff":
        return driver.buffer_size
    return FederationConfig(**config["federation"]).max_per_round()


def expected_round_size(config: Mapping[str, Any]) -> int:
    """The expected number of clients in one secure sum: the expected cohort (at least
    ``min_survivors``), or FedBuff's ``buffer_size``."""
    driver = DriverConfig(**dict(config.get("driver") or {}))
    if driver.kind == "fedbuff":
        return driver.buffer_size
    least = SecAggScenarioConfig.from_dict(config.get("secagg")).min_survivors
    return max(least, round(FederationConfig(**config["federation"]).expected_per_round()))


def exposure_warning(config: Mapping[str, Any]) -> str | None:
    """The start-time warning of a resolved config whose secure sums, at their expected
    size, expose more clients than Bell et al.'s bound allows
    (:meth:`SecAggScenarioConfig.exposure_warning`); None with secagg off."""
    secagg = SecAggScenarioConfig.from_dict(config.get("secagg"))
    if not secagg.enabled:
        return None
    return secagg.exposure_warning(expected_round_size(config))
