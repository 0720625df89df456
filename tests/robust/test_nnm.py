"""Nearest-neighbour mixing (``aggregation.nnm``): each update becomes the mean of its
``n - f`` nearest updates (itself included), before bucketing and the robust combine."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

import aggregation.nnm as nnm_module
from aggregation.bucketing import Bucketing
from aggregation.centered import CenteredClip, GeometricMedian
from aggregation.nnm import NNM, nearest_neighbours, nnm_mix
from aggregation.registry import make_robust_combine
from aggregation.robust import CoordinateMedian, RobustCombine
from server.config import AggregationConfig
from simulations.config import load_scenario

# Euclidean, not L1: from (0,0), (3,3) is nearer than (5,0) (sqrt 18 < 5), not by L1
POINTS = [[0.0, 0.0], [3.0, 3.0], [5.0, 0.0], [20.0, 20.0]]


def run(c: RobustCombine, rows, weights=None, *, version: int = 0, center=None):
    c = c.__copy__()
    c.start(len(rows[0]))
    c.begin(version=version, center=None if center is None else np.asarray(center, np.float32))
    for i, r in enumerate(rows):
        c.add(np.asarray(r, dtype=np.float32), 1.0 if weights is None else weights[i])
    return c.result()


class Recorder(RobustCombine):
    """Records the rows and weights it is given; returns their first row."""

    seen: ClassVar[list[tuple[np.ndarray, np.ndarray]]] = []

    def _combine(self, x, w):
        Recorder.seen.append((x.copy(), w.copy()))
        return x[0].copy()


def by_hand(x: np.ndarray, w: np.ndarray, f: int) -> tuple[np.ndarray, np.ndarray]:
    """NNM written out: per row, sort the others by Euclidean distance, keep n - f - 1."""
    n = len(x)
    rows, weights = [], []
    for i in range(n):
        others = sorted((j for j in range(n) if j != i),
                        key=lambda j: (float(np.linalg.norm(x[i] - x[j])), j))
        near = [i, *others[:n - f - 1]]
        rows.append(np.mean(x[near].astype(np.float64), axis=0))
        weights.append(np.mean(w[near]))
    return np.array(rows), np.array(weights)


def test_each_point_is_mixed_with_its_euclidean_nearest():
    x = np.array(POINTS, np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0])
    mixed, mw = nnm_mix(x, w, f=2)  # n - f = 2: itself and its nearest
    # (0,0)+(3,3); (3,3)+(5,0) (13 < 18); (5,0)+(3,3); (20,20)+(3,3) (578 < 625)
    np.testing.assert_allclose(mixed, [[1.5, 1.5], [4.0, 1.5], [4.0, 1.5], [11.5, 11.5]])
    # each mix carries the mean of its members' weights
    np.testing.assert_allclose(mw, [1.5, 2.5, 2.5, 3.0])
    # f = 1: three each; (0,0) takes (3,3) then (5,0)
    mixed, mw = nnm_mix(x, w, f=1)
    np.testing.assert_allclose(mixed[0], [8 / 3, 1.0], rtol=1e-6)
    np.testing.assert_allclose(mw[0], 2.0)


def test_random_points_match_the_written_out_rule():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 5)).astype(np.float32)
    w = rng.uniform(1, 5, size=9)
    for f in (1, 2, 4):
        mixed, mw = nnm_mix(x, w, f)
        want, want_w = by_hand(x, w, f)
        np.testing.assert_allclose(mixed, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mw, want_w, rtol=1e-12)


def test_itself_comes_first_even_among_duplicates():
    d = np.zeros((3, 3))  # three identical updates: every tie at distance 0
    assert nearest_neighbours(d, 1).ravel().tolist() == [0, 1, 2]
    # n - f = 1: each update is mixed with itself alone, duplicates or not
    x = np.array([[1.0, 0.0], [1.0, 0.0], [5.0, 2.0]], np.float32)
    mixed, mw = nnm_mix(x, np.array([1.0, 2.0, 3.0]), f=2)
    np.testing.assert_array_equal(mixed, x)
    np.testing.assert_array_equal(mw, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="mixes 0 updates"):
        nnm_mix(x, np.ones(3), f=3)


def test_the_combine_gets_the_mixes_and_their_weights():
    Recorder.seen = []
    run(NNM(Recorder(), f=2), POINTS, [1.0, 2.0, 3.0, 4.0])
    rows, weights = Recorder.seen[-1]
    np.testing.assert_allclose(rows, [[1.5, 1.5], [4.0, 1.5], [4.0, 1.5], [11.5, 11.5]])
    np.testing.assert_allclose(weights, [1.5, 2.5, 2.5, 3.0])


@pytest.mark.parametrize("inner", [
    lambda: CenteredClip(f=1), lambda: CenteredClip(radius=0.7, iterations=2, f=1),
    lambda: GeometricMedian(f=1), lambda: CoordinateMedian(),
    lambda: make_robust_combine("trimmed_mean", beta=0.2)])
def test_nnm_before_each_combine(inner):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 4)).astype(np.float32)
    w = rng.uniform(1, 3, size=7)
    center = [0.1, -0.2, 0.0, 0.3]
    got = run(NNM(inner(), f=1), x.tolist(), w.tolist(), center=center)
    mixed, mw = by_hand(x, w, 1)
    want = run(inner(), mixed.astype(np.float32).tolist(), mw.tolist(), center=center)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_nnm_runs_before_bucketing():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    got = run(NNM(Bucketing(CenteredClip(f=1), 2, seed=5), f=1), x.tolist(), version=4)
    mixed, mw = by_hand(x, np.ones(8), 1)
    want = run(Bucketing(CenteredClip(f=1), 2, seed=5), mixed.astype(np.float32).tolist(),
               mw.tolist(), version=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_nnm_config_builds_nnm_then_bucketing_then_the_combine():
    c = AggregationConfig(combine="centered_clip", nnm=True, f=2, bucketing=2).build(
        seed=3).combine
    assert type(c) is NNM and c.f == 2 and c.needs_center
    assert type(c.inner) is Bucketing and type(c.inner.inner) is CenteredClip
    assert AggregationConfig(combine="centered_clip", nnm=True, f=1).build().keeps_center
    assert type(AggregationConfig(combine="median", f=1).build().combine) is CoordinateMedian
    with pytest.raises(ValueError, match="needs at least 5 clients per round, got 4"):
        AggregationConfig(combine="centered_clip", nnm=True, f=2).check_clients(4)
    with pytest.raises(ValueError, match="more than f = 3"):
        AggregationConfig(combine="median", nnm=True, f=3).check_clients(3)


SMALL = ["federation.rounds=1", "train.local_epochs=1", "federation.checkpoint_every=0"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["aggregation.combine=median"], "aggregation.f = 0 would mix all n"),
    (["aggregation.combine=mean", "aggregation.f=1"], "set aggregation.nnm = false"),
    (["federation.clients=5", "secagg.enabled=true", "aggregation.combine=centered_clip",
      "aggregation.clip_radius=0.5", "aggregation.f=1"],
     "the server never sees under secagg \\(it learns only the sum\\): set aggregation.nnm"),
])
def test_nnm_refused_where_it_cannot_work(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, "aggregation.nnm=true", *overrides])


def test_an_in_process_run_mixes_every_round(run_inprocess, monkeypatch):
    calls: list[tuple[int, int]] = []
    real = nnm_module.nnm_mix

    def spy(x, w, f):
        calls.append((x.shape[0], f))
        return real(x, w, f)

    monkeypatch.setattr(nnm_module, "nnm_mix", spy)
    cfg = load_scenario("default", [
        "federation.clients=6", "federation.rounds=2", "train.local_epochs=1",
        "federation.checkpoint_every=0", "aggregation.combine=centered_clip",
        "aggregation.f=1", "aggregation.nnm=true", "attack.fraction=0.17",
        "attack.kind=sign_flip"])
    assert run_inprocess(cfg)["status"] == "completed"
    assert calls == [(6, 1), (6, 1)]
