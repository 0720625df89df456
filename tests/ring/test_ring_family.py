"""halving_doubling, all_to_all and round_robin against dist.all_reduce on real gloo process
groups of every size from 1 to 8 (powers of two and the fold for the others; even and odd
sizes for the round-robin tournament).

One process group per world size runs the three algorithms over every length and dtype;
the tests check each algorithm's part of its report.
"""

from __future__ import annotations

import pytest
import ring_workers
from ring_launch import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=range(1, 9), ids=lambda n: f"n{n}")
def report(request: pytest.FixtureRequest) -> dict[str, object]:
    n = request.param
    return {"n": n, "ranks": launch(ring_workers.family, n, timeout=300)}


@pytest.mark.parametrize("algorithm", ring_workers.FAMILY)
def test_matches_native_in_every_variant_including_wrapping_integers(
        report: dict, algorithm: str) -> None:
    fails = [f"rank {r}: {f}" for r, out in enumerate(report["ranks"])
             for f in out["fails"][algorithm]]
    assert fails == [], fails[:10]


@pytest.mark.parametrize("algorithm", ring_workers.FAMILY)
def test_all_ranks_get_bit_identical_results(report: dict, algorithm: str) -> None:
    digests = [out["digests"][algorithm] for out in report["ranks"]]
    assert len(digests[0]) > 3 * len(ring_workers.FAMILY_LENGTHS)
    differing = [k for k in digests[0] if any(d.get(k) != digests[0][k] for d in digests[1:])]
    assert differing == []


def test_each_rank_sends_what_the_algorithm_promises(report: dict) -> None:
    """all_to_all and round_robin: every rank 2(n-1)/n of the vector. halving_doubling: the
    first p ranks (p the largest power of two <= n) 2(p-1)/p, plus the result to their fold
    partner if they have one; the other ranks their vector, once."""
    n, length = report["n"], 840 * 7  # divisible by every n and p up to 8
    p = 1 << (n.bit_length() - 1)
    sent = [out["sent"] for out in report["ranks"]]
    assert [s["all_to_all"] for s in sent] == [2 * (n - 1) * length // n] * n
    assert [s["round_robin"] for s in sent] == [2 * (n - 1) * length // n] * n
    halving = [2 * (p - 1) * length // p + (length if r < n - p else 0) for r in range(p)]
    assert [s["halving_doubling"] for s in sent] == halving + [length] * (n - p)


def test_round_robin_pairs_each_rank_with_every_other_once_per_phase(report: dict) -> None:
    """Every step of round_robin swaps with one partner (sends to and receives from the
    same rank); in each phase a rank meets every other rank once, in the tournament's
    rounds (n - 1 of them for even n, n for odd n, where a rank rests in one)."""
    n = report["n"]
    rounds = n - 1 if n % 2 == 0 else n
    for rank, out in enumerate(report["ranks"]):
        peers = [tuple(p) for p in out["peers"]]
        if n == 1:
            assert peers == []
            continue
        for phase in ("reduce", "gather"):
            steps = [(step, sends, recvs) for step, sends, recvs in peers
                     if step.startswith(phase)]
            assert all(s == r and len(s) == 1 for _, s, r in steps), (rank, steps)
            assert sorted(s[0] for _, s, _ in steps) == [p for p in range(n) if p != rank]
            assert all(step.endswith(f"/{rounds}") for step, _, _ in steps), steps
        met = {}  # round -> partner, the same in both phases and symmetric across ranks
        for step, sends, _ in peers:
            met.setdefault(step.split()[-1], set()).add(sends[0])
        assert all(len(p) == 1 for p in met.values()), (rank, met)
        for rnd, (p,) in met.items():
            other = {step.split()[-1]: s[0] for step, s, _ in
                     (tuple(x) for x in report["ranks"][p]["peers"])}
            assert other[rnd] == rank, (rank, rnd, p)


def test_gloo_segments_fit_the_socket_and_keep_the_bytes_in_flight(report: dict) -> None:
    """A gloo send larger than the socket's send buffer is left to gloo's event loop, the
    thread that also reads; the schedules built on exchange() cut segments to the cap and
    put as many more in flight (segments of 4 caps, 2 in flight: 8 caps of 1 cap each)."""
    cap = ring_workers.SEGMENT_CAP
    for out in report["ranks"]:
        for alg, (biggest, in_flight) in out["segments"].items():
            assert biggest <= cap and in_flight <= 8 * cap, (alg, biggest, in_flight)
            if report["n"] > 1 and alg != "all_to_all":  # its pieces are S / n
                assert biggest == cap, (alg, biggest)  # not needlessly small
        if report["n"] > 1:  # tree sends the whole vector, 16 caps, to one peer a step
            assert out["segments"]["tree"][1] == 8 * cap, out["segments"]["tree"]
