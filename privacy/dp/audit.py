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
adversary seeing every round's model, can leak more). A correct DP run gives an estimate
at or below the accountant's epsilon, up to the estimate's statistical error (its ``mu``
has an error of about ``sqrt((1 + mu^2 / 2) / K)``); one far above it means the released
model holds less noise than the accountant assumes (a bug, or DP off).

The mean shift is one-sided: an inserted canary pulls the model toward itself, so a shift
at or below zero is no evidence of insertion and gives epsilon 0.

Pure numpy/scipy; no Flower, no I/O.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr

from privacy.dp import _checks


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
    """The audit's epsilon and the two fitted Gaussians it came from."""

    epsilon: float
    delta: float
    mu: float
    seen_mean: float
    seen_std: float
    null_mean: float
    null_std: float
    canaries: int

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


def estimate_epsilon(seen: np.ndarray, unseen: np.ndarray, delta: float) -> AuditEstimate:
    """The one-shot estimate from the cosines of inserted (``seen``) and never inserted
    (``unseen``) canaries with the final model change, at ``delta`` (see the module doc)."""
    seen_mean, seen_std = _fit(seen, "inserted canaries'")
    null_mean, null_std = _fit(unseen, "fresh canaries'")
    mu = (seen_mean - null_mean) / max(seen_std, null_std)  # one-sided: see the module doc
    eps = gaussian_mechanism_epsilon(mu, delta)
    return AuditEstimate(epsilon=eps, delta=delta, mu=mu, seen_mean=seen_mean, seen_std=seen_std,
                         null_mean=null_mean, null_std=null_std, canaries=len(seen))


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
