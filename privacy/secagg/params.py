"""Round configuration and the default choice of degree k and threshold t.

Parameter choice (after Bell et al., CCS 2020, Sec. 3-4). Each client Shamir-shares
its two secrets t-of-k among its k neighbours in a random k-regular graph. For a
round to finish, every secret the server needs must have at least t holders left;
for privacy, no client may have t or more neighbours colluding with the server.

The graph (:mod:`privacy.secagg.graph`) is a Harary graph over a uniform permutation
of the participants, drawn from a seed fixed after the corrupt set and independently of
the dropouts. So each client's neighbours are a uniform k-subset of the others, and
each neighbour drops (is corrupt) with probability delta (gamma), whoever it is.

:func:`default_k` returns the smallest k (with n*k even) such that, with
t = :func:`default_threshold` (k), when each client drops independently with
probability ``dropout_fraction`` (delta) and a ``corrupt_fraction`` (gamma) of
clients is chosen independently of the graph,

1. correctness: ``n * P[Bin(k, 1 - delta) < t] <= 2**-failure_bits``, so by a union
   bound every client keeps >= t surviving neighbours (the round cannot fail for
   lack of shares) except with probability 2^-failure_bits;
2. privacy: ``n * P[Bin(k, gamma) >= t] <= 2**-security_bits``
   (:func:`meets_security`, :func:`exposed_fraction`: why binomial), so no client has
   t corrupt neighbours except with probability 2^-security_bits;
3. connectivity: ``C(n, 2) * (delta + gamma)**(2 * floor(k/2)) <= 2**-security_bits``
   (:func:`disconnection_bound`), so the graph on the honest survivors is connected
   (the masks of separate parts would cancel separately and reveal each part's sum)
   except with that probability.

1-2 bound one client at a time and take the union over the n clients: only a row's
law (the uniform k-subset) matters, not the joint law of the rows. Both tails are
computed exactly, not by a Chernoff bound. They decay like exp(-k * D) with D the
Kullback-Leibler divergence between t/k and 1-delta (resp. gamma), so k grows like
(failure_bits*ln 2 + ln n) / D = O(log n), as in Bell et al.

Derivation of 3. With h = floor(k/2), the graph contains the circulant C_n(1..h)
(each position adjacent to those at ring distance <= h; the diameter edges of an odd k
only add edges). Let R be the positions of the clients that dropped or are corrupt and
s_1 < ... < s_m the others, in ring order. Consecutive s_i, s_(i+1) (cyclically) are
adjacent unless h or more positions between them are in R. If at most one of the m
gaps is that wide, the ring order less that one link is a path through every s_i:
connected. So a disconnected remainder needs two gaps each holding a run of h
consecutive positions of R, the two runs disjoint (a survivor lies between them). A
run is named by its first position, so there are at most C(n, 2) pairs of disjoint
runs; each pair is 2h distinct positions, all in R with probability rho^(2h), where
rho = 1 - (1-delta)(1-gamma) <= delta + gamma is the chance that a client is not an
honest survivor, independent across clients and, the permutation being independent of
who drops or is corrupt, across positions. The union bound over the pairs gives 3 (0
for the full graph, whose remainder is always connected). It asks 2h >= (security_bits
+ log2 C(n, 2)) / log2(1/rho), less than 1-2 ask at the default fractions: at
delta = 0.1, gamma = 0.05 it holds with about 40 bits to spare for every n in
3..10,000 and changes no k there. It binds when little is assumed to go wrong: with
gamma = 0, delta = 0.05 and threshold fraction 0.3, 1-2 alone take k = 11 at n = 100,
3 takes 14. A Harary graph is k-connected, so the public graph itself is connected for
every seed once k >= 2: no seed is drawn again.

When no k < n-1 satisfies 1-3, k = n-1: full SecAgg (Bonawitz et al., CCS 2017).
``corrupt_fraction`` defaults to :data:`DEFAULT_CORRUPT_FRACTION` (0.05; why, and what
it costs in k, is documented in :mod:`privacy.secagg.policy`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np

MAX_CLIENTS = 1 << 20
MAX_DIM = 1 << 34
MAX_BITS = 64
SEED_BYTES = 32
SECURITY_BITS = 40  # no client has t corrupt neighbours except with probability 2^-40
# The strict policy's minimums and assumed corrupt fraction (privacy.secagg.policy: why)
MIN_NEIGHBORS = 3
MIN_SURVIVORS = 3
DEFAULT_CORRUPT_FRACTION = 0.05
#: Security modes: against an honest-but-curious server (the default), or against a server
#: that lies (signed key advertisements, a derived graph, a consistency check:
#: :mod:`privacy.secagg.malicious`).
SEMI_HONEST = "semi_honest"
MALICIOUS = "malicious"
SECURITY_MODES = (SEMI_HONEST, MALICIOUS)
#: Message flows: "merged" (the default) sends the masked input with the shares (one
#: exchange fewer; the server falls back to the classic flow when a client sent no shares);
#: "classic" always runs FORWARDED_SHARES -> MASKED_INPUT (a masked-input stage of its own,
#: e.g. summed over a ring of silos).
MERGED = "merged"
CLASSIC = "classic"
FLOWS = (MERGED, CLASSIC)


def default_threshold(k: int, threshold_fraction: float = 0.5) -> int:
    """t = floor(fraction * k) + 1, at most k: a strict majority of neighbours by default.

    With t > k/2, fewer than half of a client's neighbours can never rebuild its
    secrets, and two disjoint neighbour groups can never rebuild both of them.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0.0 <= threshold_fraction < 1.0:
        raise ValueError(f"threshold_fraction must be in [0, 1), got {threshold_fraction}")
    return min(k, math.floor(threshold_fraction * k) + 1)


def _binomial_pmfs(k: int, p: float, lo: int, hi: int) -> list[float]:
    """P[Bin(k, p) = i] for lo <= i < hi, computed in log space (no overflow)."""
    if p <= 0.0 or p >= 1.0:
        point = 0 if p <= 0.0 else k
        return [1.0 if i == point else 0.0 for i in range(lo, hi)]
    lp, lq, lk = math.log(p), math.log1p(-p), math.lgamma(k + 1)
    return [
        math.exp(lk - math.lgamma(i + 1) - math.lgamma(k - i + 1) + i * lp + (k - i) * lq)
        for i in range(lo, hi)
    ]


def binomial_tail_below(k: int, p: float, t: int) -> float:
    """P[Bin(k, p) < t], summed term by term."""
    return math.fsum(_binomial_pmfs(k, p, 0, max(0, min(t, k + 1))))


def binomial_tail_at_least(k: int, p: float, t: int) -> float:
    """P[Bin(k, p) >= t], summed term by term (no 1 - x cancellation)."""
    return math.fsum(_binomial_pmfs(k, p, max(0, t), k + 1))


def exposed_fraction(k: int, t: int, corrupt_fraction: float) -> float:
    """The expected fraction of a round's clients with t or more corrupt neighbours among
    their k (who, with the server, can rebuild their secrets): P[Bin(k, gamma) >= t].

    Binomial, not hypergeometric: ``corrupt_fraction`` (gamma) is the colluding fraction of
    the population a round's cohort is drawn from, so each neighbour is corrupt with
    probability gamma, whatever the cohort's size. A fixed count gamma*n inside the cohort
    would make it hypergeometric, degenerate at small n (at n = 20, gamma = 0.05 there is
    one corrupt client, never two neighbours) and close to the binomial at large n.
    """
    return binomial_tail_at_least(k, corrupt_fraction, t)


def meets_security(n: int, k: int, t: int, corrupt_fraction: float,
                   security_bits: int = SECURITY_BITS) -> bool:
    """Bell et al.'s privacy bound: ``n * exposed_fraction(k, t, gamma) <=
    2**-security_bits``, the expected number of exposed clients of a round of ``n``, and by
    the union bound the most the chance that any of them is exposed can be."""
    return n * exposed_fraction(k, t, corrupt_fraction) <= 2.0**-security_bits


def disconnection_bound(n: int, k: int, dropout_fraction: float,
                        corrupt_fraction: float) -> float:
    """Condition 3 of the module docstring: ``C(n, 2) * rho**(2 * floor(k/2))`` with
    rho = delta + gamma (at most 1), the most the chance can be that the honest
    survivors' graph is disconnected; 0 for the full graph."""
    h = k // 2
    if k >= n - 1:
        return 0.0
    rho = min(1.0, dropout_fraction + corrupt_fraction)
    return math.comb(n, 2) * rho ** (2 * h)


def default_k(
    n: int,
    *,
    dropout_fraction: float = 0.1,
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
    threshold_fraction: float = 0.5,
    failure_bits: int = 20,
    security_bits: int = SECURITY_BITS,
) -> int:
    """Smallest graph degree meeting conditions 1-3 of the module docstring, else n-1."""
    if n < 2:
        raise ValueError(f"secure aggregation needs at least 2 clients, got {n}")
    if not 0.0 <= dropout_fraction < 1.0 or not 0.0 <= corrupt_fraction < 1.0:
        raise ValueError("dropout_fraction and corrupt_fraction must be in [0, 1)")
    fail_budget = 2.0**-failure_bits / n
    if dropout_fraction >= 1.0 - threshold_fraction or corrupt_fraction >= threshold_fraction:
        return n - 1  # the tails do not vanish as k grows: only the full graph
    for k in range(1, n - 1):
        if (n * k) % 2:
            continue
        t = default_threshold(k, threshold_fraction)
        if binomial_tail_below(k, 1.0 - dropout_fraction, t) > fail_budget:
            continue
        if not meets_security(n, k, t, corrupt_fraction, security_bits):
            continue
        if disconnection_bound(n, k, dropout_fraction, corrupt_fraction) > \
                2.0**-security_bits:
            continue
        return k
    return n - 1


@dataclass(frozen=True)
class SessionParams:
    """One SecAgg+ session's public parameters: everything the server announces in stage
    0; identical for all parties.

    ``participants`` are distinct client ids (uint64) in increasing order; the
    graph is built on their positions from the public ``seed`` (semi-honest mode) or from
    a seed derived from the round's signed key advertisements (``security`` "malicious":
    :mod:`privacy.secagg.malicious`; ``seed`` is then unused). ``flow``: :data:`MERGED`
    or :data:`CLASSIC`; a client refuses the messages of the other. The merged flow's
    keys advertised a round ahead (:mod:`privacy.secagg.ahead`): ``keys_ahead``, this
    session's keys are those its clients advertised with their last reply of the previous
    round (SETUP travels with PUBLIC_KEYS); ``advertise_ahead``, each client's last reply
    carries its advertisement for the next round. ``presign`` (malicious mode, with
    ``keys_ahead`` only): each client signs the survivor set S = the whole advertisement
    list with its SHARES_AND_INPUT (PRESIGNED_INPUT), so the consistency check's exchange
    is skipped; the round completes only if every listed client answers (see
    docs/PRIVACY.md, "A pre-signed survivor set").
    """

    participants: tuple[int, ...]
    k: int
    t: int
    bits: int
    dim: int
    run_id: int
    round_id: int
    seed: bytes
    security: str = SEMI_HONEST
    flow: str = MERGED
    keys_ahead: bool = False
    advertise_ahead: bool = False
    presign: bool = False

    def __post_init__(self) -> None:
        p = self.participants
        n = len(p)
        if not 2 <= n <= MAX_CLIENTS:
            raise ValueError(f"need 2..{MAX_CLIENTS} participants, got {n}")
        if any(not isinstance(c, int) or not 0 <= c < 1 << 64 for c in p):
            raise ValueError("participant ids must be integers in [0, 2**64)")
        if any(a >= b for a, b in pairwise(p)):
            raise ValueError("participant ids must be distinct and increasing")
        if not 1 <= self.k <= n - 1:
            raise ValueError(f"k must be in [1, n-1] = [1, {n - 1}], got {self.k}")
        if (n * self.k) % 2:
            raise ValueError(f"a {self.k}-regular graph on {n} nodes needs n*k even")
        if not 1 <= self.t <= self.k:
            raise ValueError(f"t must be in [1, k] = [1, {self.k}], got {self.t}")
        if not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in [1, {MAX_BITS}], got {self.bits}")
        if not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"dim must be in [1, {MAX_DIM}], got {self.dim}")
        if not 0 <= self.run_id < 1 << 64 or not 0 <= self.round_id < 1 << 32:
            raise ValueError("run_id must fit 64 bits and round_id 32 bits")
        if not isinstance(self.seed, bytes) or len(self.seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes")
        if self.security not in SECURITY_MODES:
            raise ValueError(f"security must be one of {', '.join(SECURITY_MODES)}, "
                             f"got {self.security!r}")
        if self.flow not in FLOWS:
            raise ValueError(f"flow must be one of {', '.join(FLOWS)}, got {self.flow!r}")
        if (self.keys_ahead or self.advertise_ahead) and self.flow != MERGED:
            raise ValueError("keys advertised ahead need the merged flow")
        if self.advertise_ahead and self.round_id == (1 << 32) - 1:
            raise ValueError("no round follows round 2**32 - 1 to advertise keys for")
        if self.presign and not (self.keys_ahead and self.security == MALICIOUS):
            raise ValueError("a pre-signed survivor set needs the malicious mode and keys "
                             "advertised ahead")

    @property
    def merged(self) -> bool:
        """Whether the masked input rides on the share-keys reply (:data:`MERGED`)."""
        return self.flow == MERGED

    @property
    def malicious(self) -> bool:
        return self.security == MALICIOUS

    @property
    def n(self) -> int:
        return len(self.participants)

    @property
    def word_dtype(self) -> np.dtype:
        """Little-endian uint32 for bits <= 32, else uint64."""
        return word_dtype(self.bits)

    @cached_property
    def positions(self) -> dict[int, int]:
        """Participant id -> index; a client's Shamir x-coordinate is its index + 1."""
        return {c: i for i, c in enumerate(self.participants)}

    @classmethod
    def create(
        cls,
        participants: Sequence[int],
        dim: int,
        *,
        bits: int = 32,
        k: int | None = None,
        t: int | None = None,
        dropout_fraction: float = 0.1,
        corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
        run_id: int = 0,
        round_id: int = 0,
        seed: bytes | None = None,
        security: str = SEMI_HONEST,
        flow: str = MERGED,
        keys_ahead: bool = False,
        advertise_ahead: bool = False,
        presign: bool = False,
    ) -> SessionParams:
        """Sort the ids, fill in default k and t, draw a fresh public seed.

        The default k is at least ``MIN_NEIGHBORS`` (3) or the full graph; its graph is
        connected whatever the seed (:mod:`privacy.secagg.graph`). ``presign`` asks for a
        pre-signed survivor set: it holds only in the malicious mode with ``keys_ahead``,
        and any other round runs without it."""
        ids = tuple(sorted(int(c) for c in participants))
        n = len(ids)
        if k is None:
            k = default_k(n, dropout_fraction=dropout_fraction,
                          corrupt_fraction=corrupt_fraction) if n >= 2 else 1
            k = min(max(k, MIN_NEIGHBORS), n - 1) if n >= 2 else k
            k += (n * k) % 2  # n*k even; k = n-1 never needs it
        if t is None:
            t = default_threshold(k)
        if seed is None:
            seed = os.urandom(SEED_BYTES)
        presign = presign and keys_ahead and security == MALICIOUS
        return cls(ids, k, t, bits, dim, run_id, round_id, seed, security, flow, keys_ahead,
                   advertise_ahead, presign)


def word_dtype(bits: int) -> np.dtype:
    """Words that hold values mod 2^bits: '<u4' up to 32 bits, '<u8' up to 64."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [1, {MAX_BITS}], got {bits}")
    return np.dtype("<u4") if bits <= 32 else np.dtype("<u8")
