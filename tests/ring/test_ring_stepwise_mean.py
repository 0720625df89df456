"""op="mean" on the stepwise ring (the schedule NCCL runs) and the other unpipelined
schedules, on real gloo process groups, against the mean computed from every rank's data."""

from __future__ import annotations

import pytest
import ring_workers
from ring_launch import launch


@pytest.mark.parametrize("n", [2, 3, 5])
def test_unpipelined_mean_equals_the_mean_of_every_ranks_data(n: int) -> None:
    fails = launch(ring_workers.unpipelined_mean, n, timeout=180)
    assert fails == [[] for _ in range(n)], [f for rank in fails for f in rank][:10]
