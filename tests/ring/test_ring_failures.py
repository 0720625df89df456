"""A rank that dies or hangs ends the collective on the others with RingError, in time."""

from __future__ import annotations

import time

import pytest
import ring_workers
from ring_launch import launch

pytestmark = pytest.mark.slow

TIMEOUT = 2.0
SLACK = 4.0  # detection, unwinding and a loaded machine


def _survivors(results: list, victim: int) -> list[dict]:
    assert results[victim] in (None, "hung")
    survivors = [r for rank, r in enumerate(results) if rank != victim]
    assert all(isinstance(r, dict) for r in survivors), f"a survivor did not raise: {survivors}"
    return survivors


@pytest.mark.parametrize(("algorithm", "n", "victim"), [
    ("ring", 4, 1), ("tree", 3, 2), ("master", 3, 1), ("master", 3, 0), ("native", 3, 1),
    ("round_robin", 3, 1)])
def test_a_rank_dying_mid_collective_raises_on_the_others(algorithm: str, n: int,
                                                          victim: int) -> None:
    start = time.monotonic()
    results = launch(ring_workers.survive_failure, n, victim, "die", algorithm, TIMEOUT,
                     allow_exit={victim}, timeout=60)
    for r in _survivors(results, victim):
        assert r["seconds"] <= TIMEOUT + SLACK, r
        assert r["peer"] is not None or algorithm == "native", r
        assert r["step"], r
        assert f"{algorithm} allreduce on rank" in r["message"], r
    assert time.monotonic() - start < 30


def test_a_hanging_rank_times_out_on_the_others_naming_step_and_peer() -> None:
    victim, n = 1, 3
    results = launch(ring_workers.survive_failure, n, victim, "hang", "ring", TIMEOUT,
                     timeout=60)
    survivors = _survivors(results, victim)
    for r in survivors:
        assert r["seconds"] <= TIMEOUT + SLACK, r
        assert r["peer"] in range(n), r
        assert "step" in r["step"], r
    # The hung rank's right neighbour waits on it and reports the timeout, naming it.
    right = survivors[victim]  # rank victim + 1
    assert right["timeout"] and right["peer"] == victim, right
    assert f"rank {victim} hangs or is gone" in right["message"]
