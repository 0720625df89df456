"""Adaptive robust clipping (``aggregation.arc``): the ``floor(2 (f/n)(n - f))`` largest
updates scaled to the norm of the next largest, before mixing, bucketing and the combine."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

import aggregation.arc as arc_module
from aggregation.arc import ARC, arc_clip, arc_count
from aggregation.bucketing import Bucketing
from aggregation.centered import CenteredClip
from aggregation.nnm import NNM
from aggregation.robust import CoordinateMedian, RobustCombine
from server.config import AggregationConfig
from simulations.config import load_scenario


def run(c: RobustCombine, rows, weights=None, *, center=None):
    c = c.__copy__()
    c.start(len(rows[0]))
    c.begin(version=0, center=None if center is None else np.asarray(center, np.float32))
    for i, r in enumerate(rows):
        c.add(np.asarray(r, dtype=np.float32), 1.0 if weights is None else weights[i])
    return c.result()


class Recorder(RobustCombine):
    """Records the rows and weights it is given; returns their first row."""

    seen: ClassVar[list[tuple[np.ndarray, np.ndarray]]] = []

    def _combine(self, x, w):
        Recorder.seen.append((x.copy(), w.copy()))
        return x[0].copy()


@pytest.mark.parametrize(("n", "f", "k"), [
    (20, 4, 6),   # 2 * 0.2 * 16 = 6.4
    (20, 2, 3),   # 2 * 0.1 * 18 = 3.6
    (20, 3, 5),   # 2 * 0.15 * 17 = 5.1
    (10, 5, 5),   # f = n / 2: k = n / 2
    (5, 1, 1),    # 2 * 0.2 * 4 = 1.6
    (4, 1, 1),    # 2 * 0.25 * 3 = 1.5
    (7, 0, 0),
    (9, 3, 4),    # 2 * 3 * 6 / 9 = 4 exactly
])
def test_the_clipped_count(n, f, k):
    assert arc_count(n, f) == k


def test_the_largest_are_clipped_to_the_next_largest_norm():
    # norms 1, 2, 3, 4, 5, 13 (6 rows, f = 2: k = floor(2 * 2 * 4 / 6) = 2)
    x = np.array([[1, 0], [0, 2], [3, 0], [0, 4], [3, 4], [5, 12]], np.float32)
    out, k, radius = arc_clip(x, 2)
    assert (k, radius) == (2, 4.0)
    # the two largest (13 and 5) scaled to norm 4, keeping their directions
    np.testing.assert_allclose(out[5], np.array([5, 12]) * 4 / 13, rtol=1e-6)
    np.testing.assert_allclose(out[4], [2.4, 3.2], rtol=1e-6)
    np.testing.assert_array_equal(out[:4], x[:4])  # the others untouched
    np.testing.assert_array_equal(x[5], [5, 12])  # the input is left as it was


def test_ties_at_the_radius_pass_and_nothing_is_clipped_without_f():
    x = np.array([[4, 0], [0, 4], [1, 0], [0, 1], [9, 0]], np.float32)
    out, k, radius = arc_clip(x, 1)  # k = 1: the 9 to the 4 (ties at 4 stay 4)
    assert (k, radius) == (1, 4.0)
    np.testing.assert_allclose(out, [[4, 0], [0, 4], [1, 0], [0, 1], [4, 0]])
    out, k, radius = arc_clip(x, 0)
    assert k == 0 and radius == float("inf")
    np.testing.assert_array_equal(out, x)


def test_huge_vectors_end_at_an_honest_norm():
    rng = np.random.default_rng(4)
    honest = rng.normal(size=(16, 50)).astype(np.float32)
    noise = 1000 * rng.normal(size=(4, 50)).astype(np.float32)
    out, k, radius = arc_clip(np.vstack([honest, noise]), 4)
    norms = np.linalg.norm(out, axis=1)
    assert k == 6 and radius <= np.linalg.norm(honest, axis=1).max() + 1e-4
    # the 4 noise vectors and the 2 largest honest ones sit at the radius
    assert np.allclose(norms[16:], radius, rtol=1e-5)
    assert (np.isclose(norms[:16], radius, rtol=1e-5)).sum() == 3  # 2 clipped + the (k+1)-th


def test_the_combine_gets_the_clipped_rows_and_the_weights_unchanged():
    Recorder.seen = []
    x = [[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0], [3.0, 4.0], [5.0, 12.0]]
    run(ARC(Recorder(), f=2), x, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    rows, weights = Recorder.seen[-1]
    np.testing.assert_allclose(rows, arc_clip(np.array(x, np.float32), 2)[0])
    np.testing.assert_array_equal(weights, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_arc_then_nnm_then_centered_clipping():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    x[0] *= 50
    center = [0.1, 0.0, -0.1]
    got = run(ARC(NNM(CenteredClip(f=1), f=1), f=2), x.tolist(), center=center)
    want = run(NNM(CenteredClip(f=1), f=1), arc_clip(x, 2)[0].tolist(), center=center)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_config_builds_arc_outside_nnm():
    c = AggregationConfig(combine="centered_clip", nnm=True, f=4, arc=True,
                          bucketing=2).build(seed=3).combine
    assert type(c) is ARC and c.f == 4 and c.needs_center
    assert type(c.inner) is NNM and c.inner.f == 4
    assert type(c.inner.inner) is Bucketing and type(c.inner.inner.inner) is CenteredClip
    alone = AggregationConfig(combine="median", arc=True, f=3).build().combine
    assert type(alone) is ARC and type(alone.inner) is CoordinateMedian
    with pytest.raises(ValueError, match="needs at least 9 clients per round, got 8"):
        AggregationConfig(combine="centered_clip", arc=True, f=4).check_clients(8)


SMALL = ["federation.rounds=1", "train.local_epochs=1", "federation.checkpoint_every=0"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["aggregation.arc=true", "aggregation.combine=median"],
     "none with aggregation.f = 0: set aggregation.f"),
    (["aggregation.arc=true", "aggregation.f=1"],
     "combine = 'mean' set aggregation.arc = false or choose a robust combine"),
    (["aggregation.arc=true", "federation.clients=5", "secagg.enabled=true",
      "aggregation.combine=centered_clip", "aggregation.clip_radius=0.5", "aggregation.f=1"],
     "never sees under secagg.*set aggregation.arc = false"),
])
def test_refused_where_it_cannot_work(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, *overrides])


def test_an_in_process_run_clips_every_round(run_inprocess, monkeypatch):
    calls: list[tuple[int, int]] = []
    real = arc_module.arc_clip

    def spy(x, f):
        out = real(x, f)
        calls.append((x.shape[0], out[1]))
        return out

    monkeypatch.setattr(arc_module, "arc_clip", spy)
    cfg = load_scenario("default", [
        "federation.clients=6", "federation.rounds=2", "train.local_epochs=1",
        "federation.checkpoint_every=0", "aggregation.combine=centered_clip",
        "aggregation.f=1", "aggregation.arc=true", "aggregation.nnm=true",
        "attack.fraction=0.17", "attack.kind=gaussian_noise"])
    assert run_inprocess(cfg)["status"] == "completed"
    assert calls == [(6, 1), (6, 1)]  # floor(2 * 1 * 5 / 6) = 1
