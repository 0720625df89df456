"""The round-robin tournament behind ``algorithm="round_robin"``: every round pairs ranks
off, and over one phase every pair of ranks meets exactly once."""

from __future__ import annotations

import pytest

from aggregation.ring import ALGORITHMS
from aggregation.ring.round_robin import partner, rounds


@pytest.mark.parametrize("n", range(2, 17))
def test_each_round_is_a_pairing_and_every_pair_meets_once(n: int) -> None:
    met: list[frozenset[int]] = []
    for t in range(rounds(n)):
        resting = [r for r in range(n) if partner(r, n, t) is None]
        assert len(resting) == n % 2  # one rank rests per round when n is odd
        for r in range(n):
            p = partner(r, n, t)
            if p is None:
                continue
            assert p != r and 0 <= p < n
            assert partner(p, n, t) == r  # both ends of a pair agree
            if r < p:
                met.append(frozenset((r, p)))
    assert sorted(map(sorted, met)) == [[a, b] for a in range(n) for b in range(a + 1, n)]


def test_rounds_per_phase() -> None:
    assert [rounds(n) for n in range(2, 9)] == [1, 3, 3, 5, 5, 7, 7]


def test_the_name_is_accepted_where_algorithms_are_checked() -> None:
    assert "round_robin" in ALGORITHMS
