"""The local process-group launcher returns per-rank results and surfaces failures."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from ring_launch import LaunchError, launch

pytestmark = pytest.mark.slow


def _identify(rank: int, n: int, tag: str) -> tuple[int, int, int, str]:
    return rank, n, dist.get_world_size(), tag


def _fail_on(rank: int, n: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    return rank


def _exit_on(rank: int, n: int, bad: int) -> int:
    if rank == bad:
        os._exit(3)
    return rank


def _sleep(rank: int, n: int) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order() -> None:
    assert launch(_identify, 3, "x") == [(0, 3, 3, "x"), (1, 3, 3, "x"), (2, 3, 3, "x")]


def test_a_rank_exception_is_reraised_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="boom on 1") as info:
        launch(_fail_on, 2, 1)
    assert any("raised on rank 1 of 2" in note for note in info.value.__notes__)


def test_a_rank_that_exits_without_result_is_an_error_unless_allowed() -> None:
    with pytest.raises(LaunchError, match="rank 1 exited"):
        launch(_exit_on, 2, 1)
    assert launch(_exit_on, 2, 1, allow_exit={1}) == [0, None]


def test_the_whole_run_is_bounded_by_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish"):
        launch(_sleep, 2, timeout=3)
    assert time.monotonic() - start < 15
