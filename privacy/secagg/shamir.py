"""Shamir secret sharing over the prime field GF(p), p = 2^256 + 297.

Why a prime field and not pycryptodome's ``Crypto.Protocol.SecretSharing``: that
works over GF(2^128) on 16-byte secrets, so each 32-byte secret would need two
sharings, and its field multiplication is a pure-Python bit loop: a 50-of-99
split of a 32-byte secret (what each client does twice in a full-graph round at
n = 100) takes about 330 ms that way and about 1 ms with native big ints here.
With p > 2^256 any 32-byte secret is one field element, and the share of a
holder is f(x) with x = its position + 1, encoded in 33 bytes.

p = 2^256 + 297 is the smallest prime above 2^256 (the tests re-check it with
Miller-Rabin). Secrecy: for a uniformly random polynomial of degree t-1, any t-1
shares are uniformly distributed whatever the secret (the tests check this
exhaustively in a small field, since the code is generic in the prime).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from functools import lru_cache

from privacy.secagg.errors import ProtocolError

PRIME = (1 << 256) + 297
SHARE_BYTES = 33
SECRET_BYTES = 32


def split(secret: int, t: int, xs: Sequence[int], *, prime: int = PRIME) -> list[int]:
    """Shares f(x) for each x of a random degree t-1 polynomial with f(0) = secret."""
    if not 0 <= secret < prime:
        raise ValueError("secret must lie in [0, prime)")
    if not 1 <= t <= len(xs):
        raise ValueError(f"need 1 <= t <= number of shares, got t={t}, shares={len(xs)}")
    if len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise ValueError("share x-coordinates must be distinct and in [1, prime)")
    coeffs = [secret] + [secrets.randbelow(prime) for _ in range(t - 1)]
    top = coeffs[::-1]
    shares = []
    for x in xs:
        acc = 0
        for c in top:  # Horner
            acc = (acc * x + c) % prime
        shares.append(acc)
    return shares


def reconstruct(points: Sequence[tuple[int, int]], *, prime: int = PRIME) -> int:
    """f(0) of the polynomial through all given (x, y) points (Lagrange at zero)."""
    xs = tuple(x for x, _ in points)
    return reconstruct_many(xs, [[y for _, y in points]], prime=prime)[0]


def reconstruct_many(
    xs: Sequence[int], ys: Sequence[Sequence[int]], *, prime: int = PRIME
) -> list[int]:
    """f(0) for each row of ``ys``, all shared at the same ``xs``.

    The Lagrange coefficients depend only on the x-coordinates, so they are computed
    once (and cached per x-set) and each secret costs one dot product.
    """
    xs = tuple(xs)
    if not xs:
        raise ProtocolError("no shares to reconstruct from")
    if len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise ProtocolError("share x-coordinates must be distinct and in [1, prime)")
    coeffs = lagrange_at_zero(xs, prime)
    out = []
    for row in ys:
        if len(row) != len(xs):
            raise ProtocolError(f"{len(row)} share values for {len(xs)} x-coordinates")
        if any(not 0 <= y < prime for y in row):
            raise ProtocolError("share value outside the field")
        out.append(sum(c * y for c, y in zip(coeffs, row, strict=True)) % prime)
    return out


@lru_cache(maxsize=4096)
def lagrange_at_zero(xs: tuple[int, ...], prime: int = PRIME) -> tuple[int, ...]:
    """Coefficients l_i(0) = prod_{j != i} x_j / (x_j - x_i) mod prime (distinct, nonzero xs).

    l_i(0) = X / (x_i * prod_{j != i} (x_j - x_i)) with X = prod_j x_j. The
    x-coordinates are small (holder positions), so the products are exact integer
    products, reduced once; the t denominators are inverted together with one modular
    inversion (Montgomery's trick). Cached per x-set.
    """
    total = math.prod(xs) % prime
    dens = [xi * math.prod(xj - xi for xj in xs if xj != xi) % prime for xi in xs]
    return tuple(total * inv % prime for inv in _batch_inverse(dens, prime))


def _batch_inverse(values: list[int], prime: int) -> list[int]:
    """Inverses of nonzero field elements with one pow(): prefix products, then unwind."""
    prefix, acc = [], 1
    for v in values:
        prefix.append(acc)
        acc = acc * v % prime
    inv = pow(acc, -1, prime)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inv * prefix[i] % prime
        inv = inv * values[i] % prime
    return out


def split_secret(secret: bytes, t: int, xs: Sequence[int]) -> list[bytes]:
    """Share a 32-byte secret; each share is 33 little-endian bytes."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes")
    value = int.from_bytes(secret, "little")
    return [y.to_bytes(SHARE_BYTES, "little") for y in split(value, t, xs)]


def reconstruct_secret(points: Sequence[tuple[int, bytes]]) -> bytes:
    """The 32-byte secret from (x, 33-byte share) points; ProtocolError if inconsistent."""
    xs = tuple(x for x, _ in points)
    return reconstruct_secrets(xs, [[share for _, share in points]])[0]


def reconstruct_secrets(xs: Sequence[int], shares: Sequence[Sequence[bytes]]) -> list[bytes]:
    """32-byte secrets from rows of 33-byte shares, all held at the same ``xs``.

    One set of Lagrange coefficients serves every row; ProtocolError if a share is
    malformed or a row does not reconstruct a 32-byte value.
    """
    rows = []
    for row in shares:
        ints = []
        for share in row:
            if len(share) != SHARE_BYTES:
                raise ProtocolError(f"a share must be {SHARE_BYTES} bytes, got {len(share)}")
            ints.append(int.from_bytes(share, "little"))
        rows.append(ints)
    out = []
    for value in reconstruct_many(xs, rows):
        if value >= 1 << (8 * SECRET_BYTES):
            raise ProtocolError("shares do not reconstruct a 32-byte secret")
        out.append(value.to_bytes(SECRET_BYTES, "little"))
    return out
