"""Centered clipping's radius factor (``aggregation.clip_scale``: tau = scale x the median
distance) and its iteration schedule (``clip_iterations_late`` once ``clip_late_after``
aggregates are applied)."""

from __future__ import annotations

import numpy as np
import pytest

from aggregation.bucketing import Bucketing
from aggregation.centered import CenteredClip
from aggregation.nnm import NNM
from server.config import AggregationConfig
from simulations.config import load_scenario

TRIANGLE = [[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]]  # distances to 0: 0, 4, 3 (median 3)


def run(c, rows, *, version: int = 0, center=None):
    c = c.__copy__()
    c.start(len(rows[0]))
    c.begin(version=version, center=None if center is None else np.asarray(center, np.float32))
    for r in rows:
        c.add(np.asarray(r, dtype=np.float32), 1.0)
    return c.result()


def one_iteration(rows, v, tau):
    """v + mean_i clip_tau(x_i - v), written out."""
    x = np.asarray(rows, np.float64) - v
    norms = np.linalg.norm(x, axis=1)
    return v + np.mean([d * min(1.0, tau / n) if n else d for d, n in zip(x, norms,
                                                                           strict=True)], axis=0)


@pytest.mark.parametrize(("scale", "want"), [
    (1.0, [(0 + 3 + 0) / 3, (0 + 0 + 3) / 3]),  # tau 3: (4,0) -> (3,0)
    (0.5, [0.5, 0.5]),                            # tau 1.5: (1.5,0), (0,1.5)
    (2.0, [4 / 3, 1.0]),                          # tau 6: nothing clipped, the mean
])
def test_the_radius_is_scale_times_the_median_distance(scale, want):
    out = run(CenteredClip(iterations=1, scale=scale), TRIANGLE)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert CenteredClip(scale=scale).radius_of(np.array([0.0, 4.0, 3.0])) == 3.0 * scale


def test_the_scale_applies_in_every_iteration():
    v = np.zeros(2)
    for _ in range(3):  # each iteration's tau: 0.5 x the median distance to the new centre
        dist = np.linalg.norm(np.asarray(TRIANGLE) - v, axis=1)
        v = one_iteration(TRIANGLE, v, 0.5 * float(np.median(dist)))
    out = run(CenteredClip(iterations=3, scale=0.5), TRIANGLE)
    np.testing.assert_allclose(out, v, rtol=1e-6)


def test_a_fixed_radius_takes_no_scale():
    with pytest.raises(ValueError, match="set clip_scale = 1 or clip_radius = 0"):
        CenteredClip(radius=1.0, scale=2.0)
    with pytest.raises(ValueError, match="clip_scale must be a finite number > 0"):
        CenteredClip(scale=0.0)


def test_fewer_iterations_once_late_after_aggregates_are_applied():
    cc = CenteredClip(iterations=3, late_iterations=1, late_after=2)
    assert [cc.iterations_at(v) for v in range(5)] == [3, 3, 1, 1, 1]
    assert [CenteredClip(iterations=3).iterations_at(v) for v in (0, 9)] == [3, 3]
    center = [0.5, 0.5]
    three = run(CenteredClip(iterations=3), TRIANGLE, center=center)
    one = run(CenteredClip(iterations=1), TRIANGLE, center=center)
    assert not np.allclose(three, one)
    for version, want in ((1, three), (2, one), (7, one)):
        np.testing.assert_allclose(run(cc, TRIANGLE, version=version, center=center), want)
        # the version reaches the clipping through bucketing (of 1 each) and mixing
        wrapped = NNM(Bucketing(CenteredClip(iterations=3, late_iterations=1, late_after=2,
                                             f=1), None, f=1), f=1)
        inner_want = run(CenteredClip(iterations=3 if version < 2 else 1, f=1),
                         _mixed(TRIANGLE), center=center)
        np.testing.assert_allclose(run(wrapped, TRIANGLE, version=version, center=center),
                                   inner_want, rtol=1e-6)


def _mixed(rows):
    from aggregation.nnm import nnm_mix
    mixed, _ = nnm_mix(np.asarray(rows, np.float32), np.ones(len(rows)), 1)
    return mixed.tolist()


def test_keys_reach_the_combine():
    cc = AggregationConfig(combine="centered_clip", clip_scale=1.5, clip_iterations_late=1,
                           clip_late_after=4).build().combine
    assert (cc.scale, cc.iterations, cc.late_iterations, cc.late_after) == (1.5, 3, 1, 4)
    default = AggregationConfig(combine="centered_clip").build().combine
    assert (default.scale, default.late_iterations) == (1.0, None)


SMALL = ["federation.rounds=1", "train.local_epochs=1", "federation.checkpoint_every=0"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["aggregation.combine=median", "aggregation.clip_scale=2"],
     "aggregation.clip_scale is read by centered clipping only"),
    (["aggregation.combine=geometric_median", "aggregation.clip_iterations_late=1"],
     "aggregation.clip_iterations_late is read by centered clipping only"),
    (["aggregation.combine=centered_clip", "aggregation.clip_scale=0"],
     "clip_scale must be a finite number > 0"),
    (["aggregation.combine=centered_clip", "aggregation.clip_radius=0.5",
      "aggregation.clip_scale=2"], "set clip_scale = 1 or clip_radius = 0"),
    (["aggregation.combine=centered_clip", "aggregation.clip_late_after=3"],
     "which is 0 \\(off\\): set it or remove aggregation.clip_late_after"),
    (["aggregation.combine=centered_clip", "aggregation.clip_iterations_late=-1"],
     "clip_iterations_late must be >= 1"),
    (["federation.clients=5", "secagg.enabled=true", "aggregation.combine=centered_clip",
      "aggregation.clip_radius=0.5", "aggregation.clip_iterations_late=1"],
     "each client clips once around the previous aggregate"),
])
def test_bad_settings_fail_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, *overrides])


def test_an_in_process_run_reads_scale_and_schedule(run_inprocess, monkeypatch):
    taus: list[tuple[int, float, float]] = []
    real = CenteredClip.radius_of

    def spy(self, dist):
        tau = real(self, dist)
        taus.append((self.version, tau, float(np.median(dist))))
        return tau

    monkeypatch.setattr(CenteredClip, "radius_of", spy)
    cfg = load_scenario("default", [
        "federation.clients=5", "federation.rounds=3", "train.local_epochs=1",
        "federation.checkpoint_every=0", "aggregation.combine=centered_clip",
        "aggregation.clip_scale=2.5", "aggregation.clip_iterations_late=1",
        "aggregation.clip_late_after=1"])
    assert run_inprocess(cfg)["status"] == "completed"
    # round 1 against version 0: 3 iterations; rounds 2 and 3: 1 each
    assert [v for v, _, _ in taus] == [0, 0, 0, 1, 2]
    for _, tau, median in taus:
        assert tau == pytest.approx(2.5 * median, rel=1e-12)
