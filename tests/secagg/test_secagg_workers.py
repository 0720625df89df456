"""Threads that claim chunks (``privacy.secagg.workers.share``): every chunk handed to
exactly one thread, in contiguous runs per thread (a new run where it took over another
thread's rest); a late thread leaves its part to the running ones; failures propagate."""

from __future__ import annotations

import threading
import time

import pytest

from privacy.secagg import workers
from privacy.secagg.workers import Claims, share, worker_cpu_seconds


def _drain(claims: Claims, first: bool) -> list[tuple[int, int]]:
    return list(claims.own(first))


@pytest.mark.parametrize(("total", "step"), [(1, 4), (4, 4), (5, 4), (64, 4), (65, 4), (1000, 7)])
def test_one_thread_walks_every_chunk_in_order(total, step):
    got = _drain(Claims(total, step), True)
    assert got == [(lo, min(total, lo + step)) for lo in range(0, total, step)]


def test_a_thread_that_runs_out_takes_the_back_half_of_the_largest_rest():
    claims = Claims(100, 10)  # 10 chunks, all the caller's
    caller = claims.own(True)
    assert next(caller) == (0, 10)
    thief = claims.own(False)
    assert next(thief) == (60, 70)  # 9 chunks left: the caller keeps 5, the thief takes 4
    assert [next(caller) for _ in range(5)] == [(10, 20), (20, 30), (30, 40), (40, 50),
                                                (50, 60)]
    assert next(caller) == (90, 100)  # the caller ran out: the back one of the thief's 3
    assert next(thief) == (70, 80)
    assert next(caller, None) is None  # the thief's last chunk is its own to do
    assert next(thief) == (80, 90)
    assert next(thief, None) is None


def test_a_last_partial_chunk_counts_as_a_chunk():
    claims = Claims(25, 10)  # chunks (0, 10), (10, 20), (20, 25)
    caller = claims.own(True)
    assert next(caller) == (0, 10)
    assert list(claims.own(False)) == [(20, 25)]
    assert list(caller) == [(10, 20)]


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_every_chunk_is_worked_on_exactly_once(threads):
    total, step = 10_000, 7
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def work(chunks):
        at = -1
        jumps = 0
        for lo, hi in chunks:
            jumps += lo != at
            assert lo % step == 0 and lo < hi <= min(total, lo + step)
            with lock:
                seen.append((lo, hi, threading.get_ident()))
            time.sleep(0)  # let the others claim
            at = hi
        return jumps

    results = share(total, step, threads, work)
    spans = sorted((lo, hi) for lo, hi, _ in seen)
    assert spans == [(lo, min(total, lo + step)) for lo in range(0, total, step)]
    assert 1 <= len(results) <= threads


def test_a_late_pool_thread_leaves_its_part_to_the_caller(monkeypatch):
    """All pool threads busy: the caller does every chunk and does not wait for them."""
    block = threading.Event()
    busy = [workers._pool().submit(block.wait, 30) for _ in range(workers.MAX_THREADS)]
    try:
        started = time.perf_counter()
        before = worker_cpu_seconds()
        got = share(100, 10, 4, lambda chunks: [c for c in chunks])
        assert time.perf_counter() - started < 5.0
        assert got == [[(lo, lo + 10) for lo in range(0, 100, 10)]]  # the caller's alone
        assert worker_cpu_seconds() == before  # the cancelled ones spent nothing
    finally:
        block.set()
        for f in busy:
            f.result()


def test_the_caller_takes_over_a_descheduled_thread_s_rest():
    """A pool thread that stalls after a chunk of its own: the caller does the rest of its
    range, so only the stalled chunk is left to the stalled thread."""
    stalled = threading.Event()
    release = threading.Event()
    caller = threading.get_ident()
    done: dict[str, list[tuple[int, int]]] = {"caller": [], "pool": []}

    def work(chunks):
        mine = threading.get_ident() == caller
        for i, chunk in enumerate(chunks):
            if mine:
                if i == 0:
                    assert stalled.wait(10)  # the pool thread holds a chunk and sleeps
                done["caller"].append(chunk)
            else:
                done["pool"].append(chunk)
                stalled.set()
                release.wait(0.5)
        return mine

    results = share(1000, 10, 2, work)
    release.set()
    assert results[0] is True
    assert len(done["pool"]) <= 2  # its first chunk, at most one more before the caller took over
    assert sorted(done["caller"] + done["pool"]) == [(lo, lo + 10) for lo in range(0, 1000, 10)]


@pytest.mark.parametrize("who", ["caller", "pool"])
def test_a_failure_in_any_thread_is_raised(who):
    caller = threading.get_ident()
    pool_started = threading.Event()

    def work(chunks):
        mine = threading.get_ident() == caller
        for i, _ in enumerate(chunks):
            if not mine:
                pool_started.set()
            if mine and i == 0:
                pool_started.wait(10)
            if (who == "caller") == mine:
                raise RuntimeError(f"{who} failed")
        return mine

    with pytest.raises(RuntimeError, match=f"{who} failed"):
        share(1000, 10, 2, work)
