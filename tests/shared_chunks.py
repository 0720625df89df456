"""Make :func:`privacy.secagg.workers.share` use every thread it is given, for tests that
check that work on several threads gives the result of one thread: a pool thread that
starts late would otherwise find nothing left and prove nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from privacy.secagg import workers


def every_thread_works(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Patch ``workers.share``: the caller's thread, after its first chunk, waits (up to
    10 s) until a pool thread has a chunk of its own. Returns counts of the calls that
    shared work (``"shared"``) and of all calls (``"calls"``)."""
    real = workers.share
    seen = {"shared": 0, "calls": 0}

    def share(total: int, step: int, threads: int,
              work: Callable[[Iterator[tuple[int, int]]], Any]) -> list[Any]:
        caller = threading.get_ident()
        other = threading.Event()
        seen["calls"] += 1

        def chunks_of(chunks: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int]]:
            mine = threading.get_ident() == caller
            for i, chunk in enumerate(chunks):
                if not mine:
                    other.set()
                yield chunk
                if mine and i == 0 and threads > 1 and total > step:
                    other.wait(10.0)

        result = real(total, step, threads, lambda chunks: work(chunks_of(chunks)))
        seen["shared"] += other.is_set()
        return result

    monkeypatch.setattr(workers, "share", share)
    return seen
