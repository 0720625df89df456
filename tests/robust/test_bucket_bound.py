"""Bucket size from the attacker fraction (Karimireddy, He, Jaggi 2022: s <= 1 / (2 delta),
delta = f / n): ``aggregation.bucketing = -1`` picks it in each aggregation, and a given
size above it fails at start."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest

import aggregation.bucketing as bucketing_module
from aggregation.bucketing import Bucketing, auto_bucket_size, bucket_bound
from aggregation.centered import CenteredClip
from aggregation.robust import RobustCombine
from server.config import AggregationConfig
from simulations.config import load_scenario


def largest_by_search(n: int, f: int, need: int) -> int:
    """The rule written out: the largest s in 1..n with 2 f s <= n and ceil(n / s) >= need,
    else 1."""
    ok = [s for s in range(1, n + 1) if 2 * f * s <= n and math.ceil(n / s) >= need]
    return max(ok, default=1)


def test_the_bound_and_the_automatic_size():
    assert bucket_bound(20, 4) == 2.5 and bucket_bound(7, 1) == 3.5
    assert bucket_bound(5, 0) == math.inf
    assert auto_bucket_size(20, 4) == 2  # floor(1 / (2 * 0.2))
    assert auto_bucket_size(100, 5) == 10
    # centered clipping with f = 4 needs 9 buckets: 16 updates in buckets of 2 leave 8
    assert auto_bucket_size(16, 4, need=9) == 1
    assert auto_bucket_size(100, 5, need=11) == 9  # 10 would leave 10 buckets
    for n in range(1, 41):
        for f in range(1, 6):
            for need in (1, 2 * f + 1, 2 * f + 3):
                assert auto_bucket_size(n, f, need) == largest_by_search(n, f, need), (n, f)
    with pytest.raises(ValueError, match="needs f >= 1"):
        auto_bucket_size(10, 0)


class Recorder(RobustCombine):
    seen: ClassVar[list[np.ndarray]] = []

    def _combine(self, x, w):
        Recorder.seen.append(w.copy())
        return x[0].copy()


def test_automatic_buckets_follow_each_aggregations_count():
    b = Bucketing(Recorder(), None, seed=1, f=2)
    for n, buckets in ((20, 4), (12, 4), (7, 7)):  # s = 5, 3, 1
        Recorder.seen = []
        c = b.__copy__()
        c.start(1)
        c.begin(version=0, center=None)
        for i in range(n):
            c.add(np.array([float(i)], np.float32), 1.0)
        c.result()
        assert len(Recorder.seen[-1]) == buckets
    assert b.min_updates() == 1  # the size drops to 1 before there are too few buckets
    assert Bucketing(CenteredClip(f=2), None, f=2).min_updates() == 5


def test_a_given_size_above_the_bound_fails_at_start():
    agg = AggregationConfig(combine="centered_clip", f=4, bucketing=3)
    with pytest.raises(ValueError, match=r"aggregation.bucketing = 3 exceeds 1 / \(2 f / n\) "
                                         r"= 2.5 for aggregation.f = 4 attackers among 20"):
        agg.check_clients(20)
    AggregationConfig(combine="centered_clip", f=4, bucketing=2).check_clients(20)
    AggregationConfig(combine="median", f=4, bucketing=3).check_clients(24)  # at the bound
    AggregationConfig(combine="centered_clip", bucketing=5).check_clients(20)  # f = 0: none
    with pytest.raises(ValueError, match=r"set aggregation\.bucketing = 0, or -1"):
        AggregationConfig(combine="median", f=4, bucketing=2).check_clients(12)  # bound 1.5


SMALL = ["federation.rounds=1", "train.local_epochs=1", "federation.checkpoint_every=0"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["aggregation.combine=centered_clip", "aggregation.bucketing=-1"],
     "sizes buckets from the attacker fraction aggregation.f / n, but aggregation.f = 0"),
    (["aggregation.combine=centered_clip", "aggregation.bucketing=-2"],
     "or -1 \\(from aggregation.f\\), got -2"),
    (["aggregation.combine=mean", "aggregation.bucketing=-1", "aggregation.f=1"],
     "set aggregation.bucketing = 0"),
    (["federation.clients=20", "aggregation.combine=centered_clip", "aggregation.f=4",
      "aggregation.bucketing=3"], "set aggregation.bucketing <= 2, or -1"),
    (["federation.clients=5", "secagg.enabled=true", "aggregation.combine=centered_clip",
      "aggregation.clip_radius=0.5", "aggregation.f=1", "aggregation.bucketing=-1"],
     "never sees under secagg: set aggregation.bucketing = 0"),
])
def test_bad_settings_fail_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, *overrides])


def test_an_in_process_run_sizes_buckets_from_f(run_inprocess, monkeypatch):
    sizes: list[tuple[int, int]] = []
    real = bucketing_module.bucket_means

    def spy(x, w, order, size):
        sizes.append((x.shape[0], size))
        return real(x, w, order, size)

    monkeypatch.setattr(bucketing_module, "bucket_means", spy)
    cfg = load_scenario("default", [
        "federation.clients=8", "federation.rounds=2", "train.local_epochs=1",
        "federation.checkpoint_every=0", "aggregation.combine=median", "aggregation.f=2",
        "aggregation.bucketing=-1"])
    assert cfg["aggregation"]["bucketing"] == -1
    assert run_inprocess(cfg)["status"] == "completed"
    assert sizes == [(8, 2), (8, 2)]  # floor(8 / (2 * 2))
