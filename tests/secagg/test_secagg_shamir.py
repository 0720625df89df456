"""Shamir sharing over GF(2^256 + 297)."""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter

import pytest

from privacy.secagg import ProtocolError
from privacy.secagg.shamir import (
    PRIME,
    lagrange_at_zero,
    reconstruct,
    reconstruct_many,
    reconstruct_secret,
    reconstruct_secrets,
    split,
    split_secret,
)


def _is_probable_prime(n: int, rounds: int = 40) -> bool:
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    rng = random.Random(1)
    for _ in range(rounds):
        x = pow(rng.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_prime_is_the_smallest_prime_above_2_256():
    assert PRIME == 2**256 + 297
    assert _is_probable_prime(PRIME)
    assert not any(_is_probable_prime(2**256 + c) for c in range(1, 297, 2))


@pytest.mark.parametrize(("t", "k"), [(1, 1), (1, 4), (3, 5), (5, 9), (16, 31)])
def test_any_t_shares_reconstruct(t, k):
    secret = os.urandom(32)
    xs = random.Random(t * k).sample(range(1, 1000), k)
    shares = split_secret(secret, t, xs)
    points = list(zip(xs, shares, strict=True))
    rng = random.Random(0)
    for _ in range(30):
        assert reconstruct_secret(rng.sample(points, t)) == secret
    assert reconstruct_secret(points) == secret  # more than t is fine too


@pytest.mark.parametrize(("t", "k"), [(2, 3), (3, 5), (16, 31)])
def test_t_minus_one_shares_do_not_reconstruct(t, k):
    secret = int.from_bytes(os.urandom(32), "little")
    xs = list(range(1, k + 1))
    points = list(zip(xs, split(secret, t, xs), strict=True))
    assert reconstruct(points[:t]) == secret
    assert reconstruct(points[: t - 1]) != secret
    assert reconstruct(points[1:t]) != secret


@pytest.mark.parametrize("t", [2, 3, 4])
def test_t_minus_one_shares_are_uniform_whatever_the_secret(t, monkeypatch):
    """Exhaustive in GF(7): over all random coefficients, every (t-1)-tuple of shares
    occurs exactly once for every secret, so t-1 shares say nothing about it."""
    p, xs = 7, [2, 3, 5, 6][:t]
    everything = set(itertools.product(range(p), repeat=t - 1))
    for secret in range(p):
        law = Counter()
        for coeffs in everything:
            draws = iter(coeffs)
            monkeypatch.setattr("secrets.randbelow", lambda bound, d=draws: next(d))
            law[tuple(split(secret, t, xs, prime=p)[: t - 1])] += 1
        assert set(law) == everything and set(law.values()) == {1}


def test_split_and_reconstruct_errors():
    with pytest.raises(ValueError):
        split(1, 3, [1, 2])
    with pytest.raises(ValueError):
        split(1, 1, [1, 1])
    with pytest.raises(ValueError):
        split(PRIME, 1, [1])
    with pytest.raises(ProtocolError):
        reconstruct([(1, 2), (1, 3)])
    with pytest.raises(ProtocolError):
        reconstruct([])
    with pytest.raises(ProtocolError, match="33 bytes"):
        reconstruct_secret([(1, b"\0" * 32)])


def _naive_lagrange_at_zero(xs, prime):
    """l_i(0) = prod_{j != i} x_j / (x_j - x_i), one modular inversion per coefficient."""
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num, den = num * xj % prime, den * (xj - xi) % prime
        out.append(num * pow(den, -1, prime) % prime)
    return tuple(out)


@pytest.mark.parametrize("t", [1, 2, 7, 50])
@pytest.mark.parametrize("prime", [PRIME, 7919])
def test_batched_lagrange_coefficients_match_the_textbook_formula(t, prime):
    xs = tuple(random.Random(t).sample(range(1, 7919), t))
    assert lagrange_at_zero(xs, prime) == _naive_lagrange_at_zero(xs, prime)


def test_secrets_at_shared_points_reconstruct_like_one_at_a_time():
    t, xs = 5, [4, 9, 11, 20, 31, 32, 40]
    secrets_ = [os.urandom(32) for _ in range(6)]
    shares = [split_secret(s, t, xs) for s in secrets_]
    subset = [1, 2, 4, 5, 6]  # any t holders, the same for every secret
    at = [xs[i] for i in subset]
    rows = [[row[i] for i in subset] for row in shares]
    assert reconstruct_secrets(at, rows) == secrets_
    assert [reconstruct_secret(list(zip(at, r, strict=True))) for r in rows] == secrets_
    ints = [[int.from_bytes(b, "little") for b in r] for r in rows]
    assert reconstruct_many(at, ints) == [int.from_bytes(s, "little") for s in secrets_]
    with pytest.raises(ProtocolError, match="4 share values for 5"):
        reconstruct_many(at, [ints[0][:4]])
    with pytest.raises(ProtocolError, match="distinct"):
        reconstruct_secrets([4, 4, 9, 11, 20], rows)
