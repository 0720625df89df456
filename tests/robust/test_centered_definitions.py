"""Centered clipping, the geometric median and bucketing against their papers' definitions,
on inputs small enough to compute by hand."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import numpy as np
import pytest

from aggregation import Pipeline, Validate, Weight
from aggregation.bucketing import Bucketing
from aggregation.centered import CenteredClip, GeometricMedian, clip_around
from aggregation.registry import make_robust_combine
from aggregation.robust import RobustCombine
from aggregation.update import Update


def combine(c: RobustCombine, rows: list[list[float]], weights: list[float] | None = None,
            *, center: list[float] | None = None, version: int = 0) -> np.ndarray:
    c = c.__copy__()
    c.start(len(rows[0]))
    c.begin(version=version, center=None if center is None else np.array(center, np.float32))
    for i, r in enumerate(rows):
        c.add(np.array(r, dtype=np.float32), 1.0 if weights is None else weights[i])
    return c.result()


TRIANGLE = [[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]]


# -- centered clipping: v <- v + mean_i clip_tau(x_i - v) ---------------------------------
def test_one_iteration_clips_each_distance_to_the_radius():
    # around 0 with tau 2: (0,0) stays, (4,0) -> (2,0), (0,3) -> (0,2); mean (2/3, 2/3)
    out = combine(CenteredClip(radius=2.0, iterations=1), TRIANGLE)
    np.testing.assert_allclose(out, [2 / 3, 2 / 3], rtol=1e-6)


def test_second_iteration_starts_from_the_first():
    v = (2 / 3, 2 / 3)  # the first iteration, as above
    steps = []
    for x in TRIANGLE:
        d = (x[0] - v[0], x[1] - v[1])
        n = math.hypot(*d)
        s = min(1.0, 2.0 / n)
        steps.append((s * d[0], s * d[1]))
    expected = [v[0] + sum(s[0] for s in steps) / 3, v[1] + sum(s[1] for s in steps) / 3]
    # by hand: (10/3, -2/3) has norm sqrt(104)/3 > 2 and (-2/3, 7/3) sqrt(53)/3 > 2
    assert math.hypot(10 / 3, -2 / 3) > 2 and math.hypot(-2 / 3, 7 / 3) > 2
    out = combine(CenteredClip(radius=2.0, iterations=2), TRIANGLE)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_weights_and_the_previous_aggregate_as_centre():
    # weights 2, 1, 1: (2 * 0 + (2, 0) + (0, 2)) / 4
    out = combine(CenteredClip(radius=2.0, iterations=1), TRIANGLE, [2.0, 1.0, 1.0])
    np.testing.assert_allclose(out, [0.5, 0.5], rtol=1e-6)
    # centre (1, 0), tau 1: (1,0) - v = 0; (3,0) - v = (2,0) -> (1,0); v + (0.5, 0)
    out = combine(CenteredClip(radius=1.0, iterations=1), [[1.0, 0.0], [3.0, 0.0]],
                  center=[1.0, 0.0])
    np.testing.assert_allclose(out, [1.5, 0.0], rtol=1e-6)


def test_automatic_radius_is_the_median_distance():
    # distances to 0: 0, 4, 3 -> tau 3: (4,0) -> (3,0), (0,3) stays; mean (1, 1)
    out = combine(CenteredClip(radius=0.0, iterations=1), TRIANGLE)
    np.testing.assert_allclose(out, [1.0, 1.0], rtol=1e-6)


def test_a_far_outlier_moves_the_result_by_at_most_its_share_of_the_radius():
    honest = [[1.0, 1.0]] * 4
    out = combine(CenteredClip(radius=0.5, iterations=1), [*honest, [1e6, -1e6]],
                  center=[1.0, 1.0])
    assert np.linalg.norm(out - np.array([1.0, 1.0])) == pytest.approx(0.5 / 5, rel=1e-5)


def test_clip_around_is_the_clients_step():
    # centre (1,1), delta (4,5): diff (3,4) of norm 5 -> (1.5, 2) with radius 2.5
    delta = np.array([4.0, 5.0], dtype=np.float32)
    out = clip_around(delta, np.array([1.0, 1.0], np.float32), 2.5)
    assert out is delta
    np.testing.assert_allclose(delta, [2.5, 3.0], rtol=1e-6)
    inside = np.array([1.5, 1.0], dtype=np.float32)
    np.testing.assert_allclose(clip_around(inside, np.ones(2, np.float32), 2.5), [1.5, 1.0])
    # the mean of the clients' steps is one server iteration with the same centre and radius
    x = np.array(TRIANGLE, dtype=np.float32)
    sent = [clip_around(r.copy(), np.zeros(2, np.float32), 2.0) for r in x]
    np.testing.assert_allclose(np.mean(sent, axis=0),
                               combine(CenteredClip(radius=2.0, iterations=1), TRIANGLE),
                               rtol=1e-6)


# -- geometric median: smoothed Weiszfeld --------------------------------------------------
def test_one_weiszfeld_step_by_hand():
    # 1-D points 0, 1, 10 from the mean 11/3: distances 11/3, 8/3, 19/3
    v0 = Fraction(11, 3)
    beta = [1 / abs(v0 - p) for p in (0, 1, 10)]  # uniform alpha cancels
    v1 = sum(b * p for b, p in zip(beta, (0, 1, 10), strict=True)) / sum(beta)
    out = combine(GeometricMedian(nu=1e-6, iterations=1), [[0.0], [1.0], [10.0]])
    assert out[0] == pytest.approx(float(v1), rel=1e-6)


def test_weiszfeld_converges_to_the_median_of_a_line_and_weights_count():
    out = combine(GeometricMedian(nu=1e-9, iterations=300), [[0.0], [1.0], [10.0]])
    assert out[0] == pytest.approx(1.0, abs=1e-3)
    # weight 3 on the point 10 outweighs the other two: the weighted median is 10
    out = combine(GeometricMedian(nu=1e-9, iterations=300), [[0.0], [1.0], [10.0]],
                  [1.0, 1.0, 3.0])
    assert out[0] == pytest.approx(10.0, abs=1e-3)


def test_nu_floors_the_distance():
    # starting on a point (the mean of two equal points and one more): a distance of 0 is
    # floored at nu, so that point's beta is alpha / nu
    rows = [[0.0], [0.0], [0.0]]
    out = combine(GeometricMedian(nu=0.5, iterations=3), rows)
    assert out[0] == 0.0


# -- bucketing -----------------------------------------------------------------------------
class Recorder(RobustCombine):
    """Records the rows and weights it is given; returns their first row."""

    seen: ClassVar[list[tuple[np.ndarray, np.ndarray]]] = []

    def _combine(self, x, w):
        Recorder.seen.append((x.copy(), w.copy()))
        return x[0].copy()


def test_buckets_are_weighted_means_of_a_random_partition():
    Recorder.seen = []
    values = [1.0, 2.0, 4.0, 8.0, 16.0]  # a bucket's sum names its members (binary)
    weights = [1.0, 2.0, 1.0, 1.0, 3.0]
    combine(Bucketing(Recorder(), 2, seed=7), [[v] for v in values], weights, version=3)
    means, bucket_w = Recorder.seen[-1]
    assert sorted(bucket_w.tolist()) != [] and means.shape == (3, 1)
    members = []
    for mean, bw in zip(means[:, 0], bucket_w, strict=True):
        # by hand: the weighted mean times the bucket weight is sum_i w_i x_i; find the
        # members whose weighted sum and weight match
        found = [group for group in _subsets(5) if len(group) in (1, 2)
                 and sum(weights[i] for i in group) == pytest.approx(bw)
                 and sum(weights[i] * values[i] for i in group) / bw == pytest.approx(mean)]
        assert len(found) == 1, (mean, bw)
        members.append(found[0])
    assert sorted(i for g in members for i in g) == [0, 1, 2, 3, 4]  # a partition
    assert sorted(len(g) for g in members) == [1, 2, 2]


def _subsets(n):
    return [tuple(i for i in range(n) if mask >> i & 1) for mask in range(1, 1 << n)]


def test_bucket_draw_depends_on_seed_and_round_only():
    def groups(seed, version):
        Recorder.seen = []
        combine(Bucketing(Recorder(), 2, seed=seed), [[2.0 ** i] for i in range(6)],
                version=version)
        return sorted(Recorder.seen[-1][0][:, 0].tolist())

    assert groups(1, 4) == groups(1, 4)
    assert len({tuple(groups(1, v)) for v in range(8)}) > 1  # a new draw each round
    assert len({tuple(groups(s, 0)) for s in range(8)}) > 1  # and each seed


def test_bucketing_feeds_the_robust_combine():
    # buckets of 2 of [0, 0, 10, 10] then the median of 2 means: each draw puts the two
    # 10s together or apart, so the median of the means is 5 or the mean of (0, 10)
    out = combine(Bucketing(make_robust_combine("median"), 2, seed=0),
                  [[0.0], [0.0], [10.0], [10.0]])
    assert out[0] == pytest.approx(5.0)


def test_too_few_updates_or_buckets_fail():
    cc = make_robust_combine("centered_clip", f=2)
    assert cc.min_updates() == 5
    with pytest.raises(ValueError, match="needs at least 5 clients per round, got 4"):
        cc.check(4)
    gm = make_robust_combine("geometric_median", f=1)
    with pytest.raises(ValueError, match="geometric median with f=1 needs at least 3"):
        gm.check(2)
    b = Bucketing(make_robust_combine("centered_clip", f=2), 2)
    assert b.min_updates() == 9  # ceil(9 / 2) = 5 buckets
    b.check(9)
    with pytest.raises(ValueError, match="at least 5 buckets of 2, so at least 9"):
        b.check(8)


def test_pipeline_keeps_the_applied_aggregate_as_centre_and_checkpoints_it():
    def pipe():
        return Pipeline(Validate(), Weight("uniform"), CenteredClip(radius=1.0, iterations=1))

    p = pipe()
    params = np.zeros(2, dtype=np.float32)
    for version, rows in enumerate([[[3.0, 0.0], [0.0, 0.0]], [[3.0, 0.0], [1.0, 0.0]]]):
        agg = p.open_round(dim=2, version=version)
        for i, r in enumerate(rows):
            agg.submit(Update(str(i), np.array(r, np.float32), 1, version))
        params = p.apply(params, agg.finish())
    # round 1 around 0: (1,0) and (0,0) -> (0.5, 0); round 2 around (0.5, 0): (2.5,0) ->
    # (1,0) and (0.5,0) stays -> (0.5,0) + (0.75, 0) = (1.25, 0)
    np.testing.assert_allclose(p.center, [1.25, 0.0])
    restored = pipe()
    restored.load_state_dict(p.state_dict())
    np.testing.assert_allclose(restored.center, [1.25, 0.0])
    agg = restored.open_round(dim=2, version=2)
    agg.submit(Update("0", np.array([1.25, 3.0], np.float32), 1, 2))
    np.testing.assert_allclose(agg.finish(), [1.25, 1.0])  # clipped around the restored
