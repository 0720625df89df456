"""One-shot empirical privacy estimation with random canaries.

The method of Andrew, Kairouz, Oh, Oprea, McMahan and Suriyakumar, "One-shot Empirical
Privacy Estimation for Federated Learning" (ICLR 2024, arXiv 2302.03098):

1. draw K canaries, independent directions uniform on the unit sphere of R^d (from OS
   entropy, never from the run seed, so nothing else in the run correlates with them);
2. the canaries take part in training like clients (each contributes its direction times
   the clip norm, and is sampled like a client), but are never counted as clients;
3. at the end, the cosine between the final model change ``theta_T - theta_0`` and each
   inserted canary is compared with the cosine against K fresh canaries never inserted
   (~ N(0, 1/d) in high dimension, whatever the model change). A Gaussian is fitted to each
   set, and the estimate is the epsilon, at the run's delta, of the Gaussian mechanism that
   tells them apart: sensitivity over noise std ``mu = (mean_seen - mean_fresh) / s``, with
   ``s`` the larger of the two fitted stds, and epsilon(delta) from the exact curve of the
   Gaussian mechanism. (The paper also fits unequal variances; at the few hundred canaries
   a simulation affords, the sampling noise of the two stds alone then inflates epsilon at
   small delta, so the variances are taken equal, at the larger one.)

What the number means: an *empirical, lower-bound-style estimate* of what a party
holding the final model and the canaries learns about whether a random-direction client
took part. It is not a guarantee and not a worst-case bound (a worst-case client, or an
adversary seeing every round's model, can leak more). It is a statistic of K canaries:
where the audit is tight (every canary in every round, so the final model is one Gaussian
mechanism for each) it scatters around the exact epsilon, above it about half the time.
So :func:`estimate_epsilon` also gives a one-sided lower confidence bound
(``epsilon_lower``, 95% by default), which stays at or below the exact epsilon of a
correct run in about that share of runs or more (checked on draws with a known ``mu``);
only a lower bound above the exact figure is evidence that the released model holds less
noise than accounted (a bug, or DP off).

The bound is a percentile bootstrap over the canaries: both sets of cosines are resampled
with replacement, ``mu`` is refitted exactly as the estimate is (the larger of the two
stds, the one-sided shift), and the bound is the 5% quantile of those ``mu``, mapped
through the increasing curve ``mu -> epsilon(delta)``. Unlike the textbook standard error
of ``mu`` (about ``sqrt((2 + mu^2 / 2) / K)`` for two fitted means and one std), it needs
no Gaussian shape for the inserted canaries' cosines, which under sampling are a mixture
over how often each canary took part, and it carries the larger-std rule as it is. Its
resampling generator is seeded from the cosines themselves, so the same cosines always
give the same bound.

The mean shift is one-sided: an inserted canary pulls the model toward itself, so a shift
at or below zero is no evidence of insertion and gives epsilon 0.

Pure numpy/scipy; no Flower, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr

from privacy.dp import _checks

CONFIDENCE = 0.95  # of the one-sided lower bound
RESAMPLES = 1000  # bootstrap resamples of the canaries


def canary_entropy() -> int:
    """128 bits from the operating system: the seed of one run's canaries."""
    return secrets.randbits(128)


def random_canaries(count: int, dim: int, entropy: int) -> np.ndarray:
    """``count`` float32 rows, each a direction uniform on the unit sphere of R^dim
    (a normalised standard normal vector), drawn from ``entropy``."""
    if count < 1 or dim < 2:
        raise ValueError(f"need at least one canary in at least 2 dimensions, got "
                         f"{count} in {dim}")
    rng = np.random.default_rng([entropy, count, dim])
    rows = rng.standard_normal((count, dim), dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return rows


def cosines(change: np.ndarray, canaries: np.ndarray) -> np.ndarray:
    """Cosine between ``change`` and each (unit) canary row; zeros if ``change`` is 0.
    One float32 matrix-vector product (no copy of the canaries)."""
    change = np.asarray(change, dtype=np.float32)
    norm = float(np.linalg.norm(change.astype(np.float64)))
    if norm == 0.0:
        return np.zeros(len(canaries))
    return (canaries @ change).astype(np.float64) / norm


def gaussian_mechanism_delta(mu: float, eps: float) -> float:
    """delta(eps) of the Gaussian mechanism with sensitivity / noise std ``mu`` (the exact
    curve of Balle and Wang 2018): Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""
    if mu <= 0.0:
        return 0.0
    return max(0.0, float(ndtr(mu / 2 - eps / mu) - math.exp(eps) * ndtr(-mu / 2 - eps / mu)))


def gaussian_mechanism_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon at which the Gaussian mechanism with sensitivity / noise std
    ``mu`` is (epsilon, delta)-DP (0 when ``mu`` <= 0)."""
    mu = _checks.real("mu", mu)
    delta = _checks.open_unit("delta", delta)
    if gaussian_mechanism_delta(mu, 0.0) <= delta:
        return 0.0

    def excess(eps: float) -> float:
        return gaussian_mechanism_delta(mu, eps) - delta

    hi = 1.0
    while excess(hi) > 0.0:
        hi *= 2.0
    return float(brentq(excess, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-12, rtol=1e-12))


@dataclass(frozen=True)
class AuditEstimate:
    """The audit's epsilon, its lower confidence bound and the two fitted Gaussians."""

    epsilon: float
    delta: float
    mu: float
    seen_mean: float
    seen_std: float
    null_mean: float
    null_std: float
    canaries: int
    mu_lower: float
    epsilon_lower: float
    confidence: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _fit(values: np.ndarray, what: str) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        raise ValueError(f"a Gaussian fit needs at least 2 {what} cosines, got {values.size}")
    mean, std = float(values.mean()), float(values.std(ddof=1))
    if not std > 0.0:
        raise ValueError(f"the {what} cosines do not vary (std {std}): nothing to fit")
    return mean, std


def _shifts(seen: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """``mu`` of each row pair (last axis: the canaries), as :func:`estimate_epsilon` fits
    it; a resample that does not vary counts as no evidence (0)."""
    spread = np.maximum(seen.std(axis=-1, ddof=1), unseen.std(axis=-1, ddof=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = (seen.mean(axis=-1) - unseen.mean(axis=-1)) / spread
    return np.nan_to_num(mu, nan=0.0)


def mu_lower_bound(seen: np.ndarray, unseen: np.ndarray, *, confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES) -> float:
    """One-sided ``confidence`` lower bound on ``mu``: the percentile bootstrap over both
    sets of canaries (see the module doc), seeded from the cosines."""
    seen = np.ascontiguousarray(seen, dtype=np.float64)
    unseen = np.ascontiguousarray(unseen, dtype=np.float64)
    if not 0.5 <= confidence < 1.0 or resamples < 1:
        raise ValueError(f"need 0.5 <= confidence < 1 and resamples >= 1, got {confidence} "
                         f"and {resamples}")
    digest = hashlib.sha256(seen.tobytes() + b"|" + unseen.tobytes()).digest()
    rng = np.random.default_rng(np.frombuffer(digest, dtype=np.uint32))
    mus = np.empty(resamples)
    step = max(1, 2**20 // max(seen.size, unseen.size))  # about 8 MB of indices at a time
    for start in range(0, resamples, step):
        n = min(step, resamples - start)
        mus[start:start + n] = _shifts(seen[rng.integers(0, seen.size, (n, seen.size))],
                                       unseen[rng.integers(0, unseen.size, (n, unseen.size))])
    return float(np.quantile(mus, 1.0 - confidence))


def estimate_epsilon(seen: np.ndarray, unseen: np.ndarray, delta: float, *,
                     confidence: float = CONFIDENCE) -> AuditEstimate:
    """The one-shot estimate and its one-sided ``confidence`` lower bound from the cosines
    of inserted (``seen``) and never inserted (``unseen``) canaries with the final model
    change, at ``delta`` (see the module doc)."""
    seen_mean, seen_std = _fit(seen, "inserted canaries'")
    null_mean, null_std = _fit(unseen, "fresh canaries'")
    mu = (seen_mean - null_mean) / max(seen_std, null_std)  # one-sided: see the module doc
    mu_lower = min(mu, mu_lower_bound(seen, unseen, confidence=confidence))
    return AuditEstimate(epsilon=gaussian_mechanism_epsilon(mu, delta), delta=delta, mu=mu,
                         seen_mean=seen_mean, seen_std=seen_std, null_mean=null_mean,
                         null_std=null_std, canaries=len(seen), mu_lower=mu_lower,
                         epsilon_lower=gaussian_mechanism_epsilon(mu_lower, delta),
                         confidence=confidence)


def audit_epsilon(change: np.ndarray, inserted: np.ndarray, delta: float, *,
                  entropy: int | None = None, block: int = 64) -> AuditEstimate:
    """Estimate from the final model change and the inserted canaries; the fresh canaries
    (as many as inserted) are drawn here from ``entropy`` (default: OS entropy), ``block``
    rows at a time so that they never take more memory than that."""
    count, dim = inserted.shape
    entropy = canary_entropy() if entropy is None else entropy
    unseen = np.concatenate([
        cosines(change, random_canaries(min(block, count - start), dim, entropy + start))
        for start in range(0, count, block)])
    return estimate_epsilon(cosines(change, inserted), unseen, delta)
