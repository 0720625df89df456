"""Distributed DP: integer noise added by each client before secure aggregation.

Kairouz, Liu, Steinke (ICML 2021), "The Distributed Discrete Gaussian Mechanism", and
Agarwal, Kairouz, Liu (NeurIPS 2021), "The Skellam Mechanism".

Client (:func:`distributed_encode`): clip to L2 norm C -> randomized Hadamard rotation
(shared seed; optional) -> scale by ``gamma`` -> conditional randomized rounding to
integers (redrawn until the rounded norm is within ``norm_bound``) -> add discrete
Gaussian or Skellam noise with std ``local_std`` -> int64, to be reduced mod 2^bits by
secure aggregation. Server (:func:`distributed_decode`): the sum mod 2^bits -> signed
-> divide by ``gamma`` -> undo the rotation. The result is the noisy SUM of the clipped
deltas in model units; divide by a data-independent count as in central DP.

:func:`plan_distributed_dp` picks ``gamma`` at configuration time (the k-sigma bound of
the papers) and calibrates the noise so that the decoded sum is a Gaussian-like mechanism
with the requested noise multiplier relative to the rounding-inflated norm bound.

Accounting: the plan's ``effective_noise_multiplier`` is the multiplier of the Gaussian
whose RDP bounds that of the summed noise (discrete Gaussian: the concentrated-DP bound
of Kairouz et al.; Skellam: up to terms of order 1/variance, neglected), relative to the
norm bound: the sensitivity of the sum under add/remove one client, like every multiplier
the accountant takes. Under replace-one two rounded vectors differ by up to twice the
norm bound, and the accountant halves the multiplier for fixed-size sampling; for the
discrete Gaussian that doubles the ``tau`` term as well, which only overcharges. Against the
server, which draws the cohort, no amplification by sampling is claimed (``server.dp``);
the released model's figure uses client sampling. Feeding the multiplier to
:class:`privacy.dp.accountant.PrivacyAccountant` with client sampling applies the
continuous Gaussian's amplification-by-sampling analysis to these discrete mechanisms,
which is an approximation (exact without sampling, i.e. sampling_rate=1). Why it is a
fair one: at every order the RDP of the summed noise is at most the Gaussian's with that
multiplier (the discrete Gaussian has the continuous Gaussian's concentrated-DP bound,
Canonne et al. 2020, and the ``tau`` term for summing n of them is charged in full;
Skellam exceeds it only by O(1/variance) terms, and the summed variance is
``(z * norm_bound)^2``, in the millions at useful scales). Only the sampling step is
approximate: dp_accounting's tight amplification analysis is the one for the continuous
Gaussian's privacy loss, which these lattice distributions follow closely at such
variances; the generic bound for any mechanism with that RDP curve (Zhu and Wang 2019)
would be slightly looser. dp_accounting has no event for a sampled discrete mechanism.

A round whose participants drop out before their masked input is counted holds less
noise: :meth:`DistributedDPPlan.noise_multiplier_with` gives its multiplier, which is
what the round is charged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from privacy.dp import _checks
from privacy.dp.clipping import l2_norm
from privacy.dp.discrete_gaussian import sample_discrete_gaussian
from privacy.dp.rotation import RandomizedHadamard, padded_dim
from privacy.dp.skellam import sample_skellam

MECHANISMS = ("discrete_gaussian", "skellam")
MAX_BITS = 53  # integer sums stay exact in float64 and fit int64


@dataclass(frozen=True)
class DistributedDPPlan:
    """Configuration-time parameters of distributed DP (integer units = after scaling)."""

    mechanism: str
    n_clients: int  # clients whose noise is in every sum (e.g. the SecAgg survivors' floor)
    dim: int  # length of the model delta
    padded_dim: int  # length of each encoded vector
    rotate: bool
    bits: int  # the modulus is 2**bits
    clip: float  # L2 clip in model units
    noise_multiplier: float  # requested central multiplier w.r.t. the rounded norm bound
    beta: float  # conditional rounding parameter (0: unconditional)
    k_stddevs: float  # the sum stays within k standard deviations of the modulus range
    gamma: float  # scale from model units to integer units (the papers' 1/granularity)
    norm_bound: float  # L2 norm bound of a rounded client vector, integer units
    norm_inflation: float  # norm_bound / (gamma * clip): rounding error on the sensitivity
    local_std: float  # per-client noise std, integer units
    sum_noise_std: float  # per-coordinate noise std of the decoded sum, model units
    sum_std: float  # per-coordinate std bound of the integer sum used for the headroom
    effective_noise_multiplier: float  # sum noise / sensitivity, for the accountant

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> DistributedDPPlan:
        """Rebuild a plan sent over the wire; ValueError for missing or malformed fields."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"distributed DP plan lacks {', '.join(missing)}")
        plan = cls(**{n: d[n] for n in names})  # type: ignore[arg-type]
        _checks.choice("mechanism", plan.mechanism, MECHANISMS)
        for name in ("n_clients", "dim", "padded_dim", "bits"):
            _checks.integer(name, getattr(plan, name), 1)
        for name in ("clip", "gamma", "norm_bound"):
            _checks.positive(name, getattr(plan, name))
        for name in ("noise_multiplier", "beta", "local_std", "k_stddevs"):
            _checks.non_negative(name, getattr(plan, name))
        if plan.bits > MAX_BITS or plan.padded_dim < plan.dim or not isinstance(plan.rotate, bool):
            raise ValueError("distributed DP plan has inconsistent bits, dims or rotate")
        return plan

    def for_clients(self, n: int) -> DistributedDPPlan:
        """The plan of a round with ``n`` participants (at most the planned ``n_clients``).

        Same scale and norm bound; each client's noise is ``z * norm_bound / sqrt(n)``, so
        the ``n`` clients together add exactly the planned noise, and the sum of fewer
        clients than planned stays further inside the modulus range.
        """
        n = _checks.integer("n", n, 1)
        if n > self.n_clients:
            raise ValueError(f"{n} clients exceed the {self.n_clients} the plan has room for")
        local_std = self.noise_multiplier * self.norm_bound / math.sqrt(n)
        return replace(self, n_clients=n, local_std=local_std,
                       effective_noise_multiplier=self.noise_multiplier_with(n, local_std))

    def noise_multiplier_with(self, survivors: int, local_std: float | None = None) -> float:
        """Effective multiplier of a sum holding the noise of ``survivors`` clients, each
        with std ``local_std`` (default: this plan's): what the accountant charges when
        some participants dropped out before their masked input was counted."""
        s = _checks.integer("survivors", survivors, 1)
        std = self.local_std if local_std is None else local_std
        return _effective_multiplier(self.mechanism, s, self.padded_dim, std, self.norm_bound)


def rounded_norm_bound(scaled_clip: float, dim: int, beta: float) -> float:
    """L2 bound on a vector of norm <= ``scaled_clip`` after (conditional) randomized
    rounding of its ``dim`` coordinates (Kairouz et al. 2021, Theorem 1/Sec. 4.1)."""
    worst = scaled_clip + math.sqrt(dim)
    if beta == 0.0:
        return worst
    squared = (
        scaled_clip**2
        + dim / 4.0
        + math.sqrt(2.0 * math.log(1.0 / beta)) * (scaled_clip + math.sqrt(dim) / 2.0)
    )
    return min(worst, math.sqrt(squared))


def _ddgauss_tau(n: int, sigma: float) -> float:
    k = np.arange(1, n, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1.0))))


def _effective_multiplier(
    mechanism: str, n: int, dim: int, local_std: float, bound: float
) -> float:
    if local_std == 0.0:
        return 0.0
    total_std = math.sqrt(n) * local_std
    if mechanism == "skellam":
        # Skellam's RDP is the Gaussian's plus terms of order 1/variance (Agarwal et al.,
        # Theorem 3.5), which are neglected here; they vanish for the variances in use.
        return total_std / bound
    # Sum of n discrete Gaussians: eps^2/2-concentrated DP with
    # eps = bound / (sqrt(n) sigma) + tau sqrt(d) (Kairouz et al. 2021); as RDP this is a
    # Gaussian with multiplier 1 / eps.
    return 1.0 / (bound / total_std + _ddgauss_tau(n, local_std) * math.sqrt(dim))


def _sum_variance(
    gamma: float, clip: float, n: int, dim: int, rotate: bool, z: float, beta: float
) -> tuple[float, float]:
    """(norm_bound, per-coordinate variance bound of the integer sum) at scale ``gamma``.

    Signal: with rotation each coordinate of the summed vector (norm <= n C gamma) is
    sub-Gaussian with variance proxy (n C gamma)^2 / d; without rotation one coordinate
    may hold all of it. Rounding adds at most 1/4 per client; noise adds (z * bound)^2.
    """
    bound = rounded_norm_bound(gamma * clip, dim, beta)
    signal = (gamma * clip * n) ** 2 / (dim if rotate else 1)
    return bound, signal + n / 4.0 + (z * bound) ** 2


def _best_gamma(
    clip: float, n: int, dim: int, rotate: bool, z: float, beta: float, limit: float
) -> float | None:
    """Largest gamma whose sum stays within ``limit`` standard deviations, or None."""

    def fits(g: float) -> bool:
        return _sum_variance(g, clip, n, dim, rotate, z, beta)[1] <= limit

    if not fits(0.0):
        return None
    lo, hi = 0.0, 1.0 / clip
    while fits(hi):
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if fits(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo


def plan_distributed_dp(
    n_clients: int,
    dim: int,
    clip: float,
    noise_multiplier: float,
    bits: int,
    mechanism: str = "discrete_gaussian",
    *,
    beta: float = math.exp(-0.5),
    k_stddevs: float | None = None,
    rotate: bool = True,
    max_norm_inflation: float = 1.25,
    wrap_probability: float = 1e-6,
) -> DistributedDPPlan:
    """Choose the scale ``gamma`` and the per-client noise for distributed DP.

    ``gamma`` is the largest scale for which ``k_stddevs`` standard deviations of every
    coordinate of the integer sum (signal + rounding + noise) fit in
    [-2^(bits-1), 2^(bits-1)). By default ``k_stddevs = sqrt(2 ln(2 d / wrap_probability))``:
    the sub-Gaussian tail bound with a union bound over the d coordinates, so that some
    coordinate of a round's sum wraps with probability at most ``wrap_probability``
    (Skellam tails are only approximately sub-Gaussian, close to it at large variance).
    The noise is calibrated to the rounded norm bound, so the decoded sum has noise std
    ``noise_multiplier * clip * norm_inflation``.

    Raises ValueError when even the best scale leaves a rounding inflation of the norm
    bound above ``max_norm_inflation``, naming the bits that would do. ``n_clients`` is the
    number of clients whose noise is certain to be in the sum: with dropouts, the smallest
    number of survivors SecAgg accepts, not the number selected.
    """
    n = _checks.integer("n_clients", n_clients, 1)
    dim = _checks.integer("dim", dim, 1)
    clip = _checks.positive("clip", clip)
    z = _checks.non_negative("noise_multiplier", noise_multiplier)
    bits = _checks.integer("bits", bits, 2)
    if bits > MAX_BITS:
        raise ValueError(f"bits must be <= {MAX_BITS}, got {bits}")
    mechanism = _checks.choice("mechanism", mechanism, MECHANISMS)
    beta = _checks.real("beta", beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    max_inflation = _checks.real("max_norm_inflation", max_norm_inflation)
    if max_inflation <= 1.0:
        raise ValueError(f"max_norm_inflation must be > 1, got {max_inflation}")
    d = padded_dim(dim) if rotate else dim
    if k_stddevs is None:
        p_wrap = _checks.open_unit("wrap_probability", wrap_probability)
        k = math.sqrt(2.0 * math.log(2.0 * d / p_wrap))
    else:
        k = _checks.positive("k_stddevs", k_stddevs)

    def attempt(b: int) -> tuple[float, float] | None:
        limit = (2.0 ** (b - 1) / k) ** 2
        g = _best_gamma(clip, n, d, rotate, z, beta, limit)
        if g is None or g == 0.0:
            return None
        inflation = rounded_norm_bound(g * clip, d, beta) / (g * clip)
        return g, inflation

    found = attempt(bits)
    if found is None or found[1] > max_inflation:
        needed = None
        for more in range(bits + 1, MAX_BITS + 1):
            candidate = attempt(more)
            if candidate is not None and candidate[1] <= max_inflation:
                needed = more
                break
        what = (
            "no scale keeps the sum in range"
            if found is None
            else f"rounding inflates the norm bound {found[1]:.3g}x (limit {max_inflation})"
        )
        fix = f"raise bits to at least {needed}" if needed else f"no bits <= {MAX_BITS} suffice"
        raise ValueError(
            f"distributed DP does not fit in bits={bits} with n_clients={n}, dim={dim}, "
            f"noise_multiplier={z}, k_stddevs={k:.3g}: {what}; {fix}, or lower n_clients "
            "(clients summed per round), noise_multiplier or k_stddevs/wrap_probability"
            + ("" if rotate else ", or turn rotation on")
            + "; changing clip does not help, the scale adapts to it"
        )
    gamma, inflation = found
    bound, variance = _sum_variance(gamma, clip, n, d, rotate, z, beta)
    local_std = z * bound / math.sqrt(n)
    return DistributedDPPlan(
        mechanism=mechanism,
        n_clients=n,
        dim=dim,
        padded_dim=d,
        rotate=rotate,
        bits=bits,
        clip=clip,
        noise_multiplier=z,
        beta=beta,
        k_stddevs=k,
        gamma=gamma,
        norm_bound=bound,
        norm_inflation=inflation,
        local_std=local_std,
        sum_noise_std=math.sqrt(n) * local_std / gamma,
        sum_std=math.sqrt(variance),
        effective_noise_multiplier=_effective_multiplier(mechanism, n, d, local_std, bound),
    )


def clip_l2_exact(x: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """:func:`privacy.dp.clip_l2` in float64: ``(clipped, norm_before)``.

    At the scales distributed DP uses (``gamma * clip`` up to ~1e9) the norm bound of
    conditional rounding leaves a relative slack of about ``1 / (gamma * clip)``, far below
    float32's rounding of a clipped norm (1e-7), so the clipping must be float64.
    """
    clip = _checks.positive("clip", clip)
    v = np.asarray(x, dtype=np.float64)
    norm = l2_norm(v)
    if not math.isfinite(norm):
        raise ValueError("delta contains NaN or inf; reject the update before clipping it")
    return (v * (clip / norm) if norm > clip else v), norm


def conditional_round(
    x: np.ndarray,
    norm_bound: float,
    beta: float,
    rng: np.random.Generator,
    max_tries: int = 1000,
) -> np.ndarray:
    """Unbiased randomized rounding of each coordinate to an adjacent integer, redrawn until
    the L2 norm of the result is at most ``norm_bound`` (with ``beta == 0`` the bound
    ``||x|| + sqrt(d)`` always holds and no redraw happens). Returns int64."""
    x = np.asarray(x, dtype=np.float64)
    low = np.floor(x)
    frac = x - low
    for _ in range(max_tries):
        rounded = low + (rng.random(x.shape) < frac)
        if beta == 0.0 or l2_norm(rounded) <= norm_bound:
            return rounded.astype(np.int64)
    raise RuntimeError(
        f"conditional rounding exceeded the norm bound {max_tries} times; the input norm is "
        "larger than the plan's clip (clip it first) or beta is too small"
    )


def distributed_encode(
    delta: np.ndarray,
    plan: DistributedDPPlan,
    rng: np.random.Generator,
    rotation_seed: int | None = None,
) -> tuple[np.ndarray, float]:
    """Client side: returns ``(encoded, norm_before_clipping)``; ``encoded`` is an int64
    vector of length ``plan.padded_dim`` (signed; reduce it mod 2**plan.bits for SecAgg).
    ``rotation_seed`` must be the round's shared seed when ``plan.rotate``."""
    x = np.ravel(delta)
    if x.size != plan.dim:
        raise ValueError(f"delta has {x.size} elements but the plan is for dim={plan.dim}")
    clipped, norm = clip_l2_exact(x, plan.clip)
    if plan.rotate:
        if rotation_seed is None:
            raise ValueError("pass rotation_seed: the plan rotates, with a seed shared per round")
        scaled = RandomizedHadamard(plan.dim, rotation_seed).forward(clipped)
    else:
        scaled = clipped.astype(np.float64)
    scaled *= plan.gamma
    encoded = conditional_round(scaled, plan.norm_bound, plan.beta, rng)
    sampler = sample_skellam if plan.mechanism == "skellam" else sample_discrete_gaussian
    encoded += sampler(encoded.shape, plan.local_std, rng)
    return encoded, norm


def wrap_to_signed(values: np.ndarray, bits: int) -> np.ndarray:
    """Reduce integers mod 2**bits and map them to [-2^(bits-1), 2^(bits-1)) as int64."""
    bits = _checks.integer("bits", bits, 1)
    if bits > 62:
        raise ValueError(f"bits must be <= 62, got {bits}")
    modulus = 1 << bits
    # as int64 first (uint64 wraps, which keeps every residue mod 2^bits): numpy refuses
    # a modulus that does not fit the input's own unsigned type
    v = np.mod(np.asarray(values).astype(np.int64), modulus)
    v[v >= modulus >> 1] -= modulus
    return v


def distributed_decode(
    summed: np.ndarray, plan: DistributedDPPlan, rotation_seed: int | None = None
) -> np.ndarray:
    """Server side: the (modular) sum of the encoded vectors -> float32 noisy sum of the
    clipped deltas, length ``plan.dim``."""
    s = np.ravel(summed)
    if s.size != plan.padded_dim:
        raise ValueError(f"sum has {s.size} elements, the plan expects {plan.padded_dim}")
    y = wrap_to_signed(s, plan.bits).astype(np.float64) / plan.gamma
    if plan.rotate:
        if rotation_seed is None:
            raise ValueError("pass rotation_seed: the plan rotates, with a seed shared per round")
        y = RandomizedHadamard(plan.dim, rotation_seed).inverse(y)
    return y.astype(np.float32)
