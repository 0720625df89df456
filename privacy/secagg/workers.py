"""Worker threads for large mask, encoding and summing work, and the CPU time they spend.

The heavy loops (AES-CTR in ``cryptography``, numpy ufuncs, the compiled quantizer)
release the GIL, so a vector cut into contiguous spans is worked on by several threads
at once. :func:`run` works on the first span itself and hands the others to a
process-wide pool, then adds the pool threads' CPU time to the calling thread's
:func:`worker_cpu_seconds`, so that a caller measuring its own CPU time
(``time.thread_time``) can count what it delegated.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
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


def worker_cpu_seconds() -> float:
    """CPU seconds spent so far by worker threads in this thread's calls of :func:`run`."""
    return getattr(_WAITED, "cpu", 0.0)


def cpu_seconds() -> float:
    """This thread's CPU seconds plus those of the workers it waited for: a clock that
    counts the work :func:`run` delegated."""
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
