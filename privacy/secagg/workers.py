"""Worker threads for large mask, encoding and summing work, and the CPU time they spend.

The heavy loops (AES-CTR in ``cryptography``, numpy ufuncs, the compiled quantizer)
release the GIL, so a vector cut into contiguous spans is worked on by several threads
at once. :func:`run` works on the first span itself and hands the others to a
process-wide pool; :func:`share` lets the threads claim chunks as they go (a thread
that runs out takes the back half of the largest range left), so a worker that starts
late, or is descheduled on a busy machine, leaves its part to the threads that are
running instead of holding the caller up. Both add the pool threads' CPU time to the
calling thread's :func:`worker_cpu_seconds`, so that a caller measuring its own CPU
time (``time.thread_time``) can count what it delegated.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

MAX_THREADS = 8
_POOL: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child starts its own
_POOL_LOCK = threading.Lock()
_WAITED = threading.local()  # per calling thread: CPU seconds of the workers it waited for

T = TypeVar("T")


def default_threads() -> int:
    """The cores this process may use, up to :data:`MAX_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def spans(total: int, step: int, parts: int) -> list[tuple[int, int]]:
    """Up to ``parts`` contiguous spans covering [0, total), each starting at a multiple
    of ``step`` (a chunk, an AES block) and as equal as whole steps allow."""
    steps = -(-total // step)
    parts = max(1, min(parts, steps))
    bounds = [min(total, (steps * i // parts) * step) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo] or [(0, total)]


def run(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result: the first job runs in this thread, the others on the pool at the
    same time; raises what a job raised, once all have ended. The pool threads' CPU time
    is added to :func:`worker_cpu_seconds`."""
    futures = [_pool().submit(_timed, job) for job in jobs[1:]]
    try:
        first = jobs[0]()
    finally:
        wait(futures)  # they write where the caller reads: never leave one running
        spent = sum(f.result()[1] for f in futures if f.exception() is None)
        _WAITED.cpu = worker_cpu_seconds() + spent
    return [first, *(f.result()[0] for f in futures)]


class Claims:
    """Contiguous ranges of [0, total), one per thread, handed out a chunk of ``step``
    items at a time (chunks start at multiples of ``step``). A thread whose range is
    empty takes the back half, in whole chunks, of the largest range left, so each
    thread mostly walks forward through one contiguous range (an AES-CTR stream goes on
    without a new cipher) and no thread waits while another still has two chunks to do."""

    def __init__(self, total: int, step: int) -> None:
        self.step = step
        self._lock = threading.Lock()
        self._ranges: list[list[int]] = [[0, total]]  # the caller's: it starts with all

    def own(self, first: bool) -> Iterator[tuple[int, int]]:
        """The chunks one thread works on, in order: the first range (the caller's) or a
        new, empty one that steals."""
        if first:
            mine = self._ranges[0]
        else:
            mine = [0, 0]
            with self._lock:
                self._ranges.append(mine)
        while (chunk := self._next(mine)) is not None:
            yield chunk

    def close(self) -> None:
        """Hand out nothing more (a thread failed: the others stop at their next chunk)."""
        with self._lock:
            for r in self._ranges:
                r[0] = r[1]

    def _next(self, mine: list[int]) -> tuple[int, int] | None:
        with self._lock:
            if mine[0] >= mine[1]:
                victim = max(self._ranges, key=lambda r: r[1] - r[0])
                chunks = -(-(victim[1] - victim[0]) // self.step)
                if chunks < 2:  # nothing to share: its owner is on its last chunk
                    return None
                mid = victim[0] + -(-chunks // 2) * self.step
                mine[0], mine[1], victim[1] = mid, victim[1], mid
            lo = mine[0]
            mine[0] = min(mine[1], lo + self.step)
            return lo, mine[0]


def share(total: int, step: int, threads: int,
          work: Callable[[Iterator[tuple[int, int]]], T]) -> list[T]:
    """``work`` on up to ``threads`` threads over chunks of [0, ``total``), each chunk
    [lo, hi) (lo a multiple of ``step``) handed to exactly one thread. Each thread calls
    ``work`` with its chunks: runs of contiguous ones, a new run (not necessarily further
    on) where it took over another thread's rest. This thread works too; a pool thread
    that has not started when this thread is done is cancelled. Returns each started
    thread's result, this thread's first; raises what a thread raised, once all started
    ones have ended. The pool threads' CPU time is added to :func:`worker_cpu_seconds`."""
    claims = Claims(total, step)
    if threads <= 1 or total <= step:
        return [work(claims.own(True))]
    futures = [_pool().submit(_timed, lambda: work(claims.own(False)))
               for _ in range(threads - 1)]
    try:
        first = work(claims.own(True))
    except BaseException:
        claims.close()
        raise
    finally:
        # one not started is cancelled (nothing is left for it; wait() would wait until a
        # pool thread dequeued it); the others write where the caller reads: wait for them
        started = [f for f in futures if not f.cancel()]
        wait(started)
        spent = sum(f.result()[1] for f in started if f.exception() is None)
        _WAITED.cpu = worker_cpu_seconds() + spent
    return [first, *(f.result()[0] for f in started)]


def worker_cpu_seconds() -> float:
    """CPU seconds spent so far by worker threads in this thread's calls of :func:`run` and
    :func:`share`."""
    return getattr(_WAITED, "cpu", 0.0)


def cpu_seconds() -> float:
    """This thread's CPU seconds plus those of the workers it waited for: a clock that
    counts the work :func:`run` and :func:`share` delegated."""
    return time.thread_time() + worker_cpu_seconds()


def _timed(job: Callable[[], T]) -> tuple[T, float]:
    started = time.thread_time()
    result = job()
    return result, time.thread_time() - started


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        pid = os.getpid()
        if pid not in _POOL:
            _POOL.clear()  # an inherited pool's threads do not exist in this process
            _POOL[pid] = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="secagg-worker")
        return _POOL[pid]
