"""Robustness, too-few-updates errors, the factory, NormBound and use in a Pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from aggregation.combine import WeightedMean
from aggregation.pipeline import Pipeline
from aggregation.registry import ROBUST_KINDS, make_robust_combine
from aggregation.robust import (
    Bulyan,
    CoordinateMedian,
    Krum,
    MultiKrum,
    NormBound,
    RobustCombine,
    TrimmedMean,
)
from aggregation.stages import Candidate, Clip, UpdateStage, Validate, Weight
from aggregation.update import Update


def run(combine, x: np.ndarray, weights=None) -> np.ndarray:
    combine.start(x.shape[1])
    for i, row in enumerate(x):
        combine.add(row, 1.0 if weights is None else float(weights[i]))
    return combine.result()


# --- robustness -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_twenty_percent_outliers(seed):
    rng = np.random.default_rng(seed)
    n, d, bad = 20, 50, 4
    honest = (1.0 + 0.1 * rng.standard_normal((n - bad, d))).astype(np.float32)
    outliers = (1e6 * rng.standard_normal((bad, d))).astype(np.float32)
    x = np.concatenate([honest, outliers])[rng.permutation(n)]
    target = honest.mean(axis=0)
    weights = rng.integers(1, 100, n)

    assert np.linalg.norm(run(WeightedMean(), x, weights) - target) > 1e4
    for combine in (CoordinateMedian(), TrimmedMean(0.2), Krum(bad), MultiKrum(bad),
                    Bulyan(bad), Bulyan(bad, "multikrum")):
        err = np.linalg.norm(run(combine, x, weights) - target)
        # one honest update is ~0.1 * sqrt(50) = 0.7 away from the honest mean
        assert err < 1.0, (combine.describe(), err)


def test_krum_family_never_picks_an_outlier():
    rng = np.random.default_rng(5)
    honest = rng.standard_normal((8, 10)).astype(np.float32)
    outliers = (honest[:2] + 50).astype(np.float32)  # a colluding pair, close together
    x = np.concatenate([outliers, honest])
    chosen = run(Krum(2), x)
    assert any(np.array_equal(chosen, h) for h in honest)
    assert set(MultiKrum(2).selected(x).tolist()) == set(range(2, 10))
    with pytest.raises(ValueError, match="Bulyan with f=2 needs at least 11"):
        Bulyan(2).selected(x)


# --- too few updates ------------------------------------------------------------------

def test_check_messages():
    with pytest.raises(ValueError) as err:
        Krum(3).check(6)
    assert str(err.value) == ("Krum with f=3 needs more than 8 clients per round, got 6: "
                              "lower f or sample more clients")
    with pytest.raises(ValueError) as err:
        Bulyan(2).check(10)
    assert str(err.value) == ("Bulyan with f=2 needs at least 11 clients per round, got 10: "
                              "lower f or sample more clients")
    with pytest.raises(ValueError) as err:
        MultiKrum(1).check(4)
    assert str(err.value) == ("Multi-Krum with f=1 needs more than 4 clients per round, "
                              "got 4: lower f or sample more clients")
    with pytest.raises(ValueError) as err:
        MultiKrum(2, m=9).check(10)
    assert str(err.value) == ("Multi-Krum with f=2, m=9 needs at least m + f = 11 clients "
                              "per round, got 10: lower m or f, or sample more clients")
    with pytest.raises(ValueError, match="CoordinateMedian needs at least 1"):
        CoordinateMedian().check(0)


@pytest.mark.parametrize("f", [0, 1, 3])
def test_check_boundaries(f):
    Krum(f).check(2 * f + 3)
    MultiKrum(f).check(2 * f + 3)
    Bulyan(f).check(4 * f + 3)
    TrimmedMean(0.4).check(1)
    for combine, n in ((Krum(f), 2 * f + 2), (MultiKrum(f), 2 * f + 2), (Bulyan(f), 4 * f + 2)):
        with pytest.raises(ValueError, match="clients per round"):
            combine.check(n)


def test_result_raises_with_too_few_updates():
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    with pytest.raises(ValueError) as err:
        run(Krum(3), x)
    assert str(err.value) == ("Krum with f=3 needs more than 8 updates per aggregation, "
                              "got 6: lower f or sample more clients")
    with pytest.raises(ValueError, match="Bulyan with f=1 needs at least 7 updates per "
                                         "aggregation, got 6"):
        run(Bulyan(1), x)
    with pytest.raises(ValueError, match="m \\+ f = 7 updates per aggregation, got 6"):
        run(MultiKrum(1, m=6), x)
    run(Krum(1), x)  # 6 > 2 * 1 + 2
    run(MultiKrum(1, m=5), x)


def test_empty_start_and_shape():
    c = Krum(0)
    assert c.result() is None  # before start
    c.start(3)
    assert c.result() is None  # nothing added
    with pytest.raises(ValueError, match="shape"):
        c.add(np.zeros(4, dtype=np.float32), 1.0)
    with pytest.raises(RuntimeError, match="start"):
        CoordinateMedian().add(np.zeros(3, dtype=np.float32), 1.0)


def test_add_copies_and_start_resets():
    c = CoordinateMedian()
    c.start(2)
    delta = np.array([1.0, 2.0], dtype=np.float32)
    c.add(delta, 1.0)
    delta[:] = 100.0  # the caller reuses its buffer
    assert c.result().tolist() == [1.0, 2.0]
    c.start(2)
    assert c.count == 0 and c.result() is None
    for i in range(9):  # grows past the initial capacity
        c.add(np.full(2, float(i), dtype=np.float32), 1.0)
    assert c.count == 9 and c.result().tolist() == [4.0, 4.0]


@pytest.mark.parametrize("bad", [
    lambda: Krum(-1), lambda: Krum(1.5), lambda: Krum(True), lambda: Bulyan("2"),
    lambda: MultiKrum(1, m=0), lambda: TrimmedMean(0.5), lambda: TrimmedMean(-0.1),
    lambda: Bulyan(1, selection="median"), lambda: NormBound(0.0),
    lambda: NormBound(float("inf")),
])
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        bad()


# --- factory --------------------------------------------------------------------------

def test_factory():
    assert ROBUST_KINDS == ("median", "trimmed_mean", "krum", "multikrum", "bulyan",
                            "centered_clip", "geometric_median")
    assert isinstance(make_robust_combine("median"), CoordinateMedian)
    assert make_robust_combine("trimmed_mean", beta=0.1).beta == 0.1
    assert make_robust_combine("krum", f=2.0).f == 2  # integral floats from config files
    mk = make_robust_combine("multikrum", f=1, m=3)
    assert (type(mk), mk.f, mk.m) == (MultiKrum, 1, 3)
    assert make_robust_combine("multikrum", f=1).m is None
    b = make_robust_combine("bulyan", f=1, selection="multikrum")
    assert (type(b), b.f, b.selection) == (Bulyan, 1, "multikrum")
    for kind in ROBUST_KINDS:
        combine = make_robust_combine(kind, **{"trimmed_mean": {"beta": 0.2}}.get(
            kind, {} if kind == "median" else {"f": 1}))
        assert isinstance(combine, RobustCombine) and combine.linear is False


@pytest.mark.parametrize(("kind", "params", "match"), [
    ("geomed", {}, "unknown robust combine 'geomed'; choose one of: median, trimmed_mean"),
    ("median", {"beta": 0.1}, "unknown parameters \\['beta'\\]; it takes: none"),
    ("krum", {"f": 1, "m": 2}, "unknown parameters \\['m'\\]; it takes: f"),
    ("krum", {}, "needs parameters \\['f'\\]"),
    ("trimmed_mean", {}, "needs parameters \\['beta'\\]"),
    ("bulyan", {"f": -1}, "f must be >= 0"),
])
def test_factory_errors(kind, params, match):
    with pytest.raises(ValueError, match=match):
        make_robust_combine(kind, **params)


# --- NormBound ------------------------------------------------------------------------

def candidate(delta) -> Candidate:
    d = np.asarray(delta, dtype=np.float32)
    return Candidate(update=Update("c", d, num_examples=1, base_version=0), staleness=0)


def test_norm_bound_is_clip():
    nb = NormBound(5.0)
    assert isinstance(nb, Clip) and isinstance(nb, UpdateStage) and nb.max_norm == 5.0
    assert repr(nb) == "NormBound(max_norm=5.0)"
    big = candidate([3.0, 4.0, 12.0])  # norm 13
    nb.process(big, 3, 0)
    np.testing.assert_allclose(big.delta, np.array([3.0, 4.0, 12.0]) * 5.0 / 13.0, rtol=1e-6)
    assert big.norm == 5.0
    small = candidate([3.0, 4.0])  # norm 5: kept as is
    before = small.delta
    nb.process(small, 2, 0)
    assert small.delta is before


def test_norm_bound_matches_sun_et_al():
    rng = np.random.default_rng(0)
    for _ in range(20):
        delta = rng.standard_normal(7) * rng.uniform(0.1, 10)
        c = candidate(delta)
        NormBound(3.0).process(c, 7, 0)
        want = delta / max(1.0, float(np.sqrt(np.sum(delta ** 2))) / 3.0)
        np.testing.assert_allclose(c.delta, want, rtol=1e-6)


# --- inside a pipeline ----------------------------------------------------------------

def test_pipeline_with_robust_combine():
    rng = np.random.default_rng(1)
    pipe = Pipeline(Validate(), NormBound(10.0), Weight("examples"), Krum(1))
    assert pipe.linear is False
    x = rng.standard_normal((6, 4)).astype(np.float32)
    x[0] = 1000.0  # bounded to norm 10, still the odd one out
    agg = pipe.open_round(dim=4, version=0)
    for i, row in enumerate(x):
        assert agg.submit(Update(f"c{i}", row.copy(), num_examples=i + 1,
                                 base_version=0)).accepted
    np.testing.assert_array_equal(agg.finish(), _krum_reference(x))
    params = np.zeros(4, dtype=np.float32)
    assert pipe.apply(params, agg.finish()).shape == (4,)


def _krum_reference(x: np.ndarray) -> np.ndarray:
    bounded = [row * min(1.0, 10.0 / float(np.linalg.norm(row))) for row in x]
    scores = []
    for i, a in enumerate(bounded):
        near = sorted(float(np.sum((a - b) ** 2)) for j, b in enumerate(bounded) if j != i)
        scores.append(sum(near[:len(x) - 1 - 2]))
    return np.asarray(bounded[int(np.argmin(scores))], dtype=np.float32)
