"""Long vectors (one BLAS call each): a late rejection leaves no trace in the aggregate."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from aggregation import Pipeline, Update, Validate, Weight, WeightedMean

D = 300_000  # well past OpenBLAS's 10,000-element threading threshold


def _aggregate(updates: list[Update], max_norm: float | None = None) -> tuple:
    agg = Pipeline(Validate(max_norm=max_norm), Weight("examples"),
                   WeightedMean()).open_round(dim=D, version=0)
    verdicts = [agg.submit(u) for u in updates]
    return agg.finish(), verdicts


@pytest.mark.parametrize("where", ["nan-at-end", "inf-in-middle", "norm-from-tail"])
def test_a_late_rejection_changes_nothing(where):
    rng = np.random.default_rng(3)
    a, b, bad = (rng.standard_normal(D, dtype=np.float32) for _ in range(3))
    max_norm = None
    if where == "nan-at-end":
        bad[-1] = np.nan
    elif where == "inf-in-middle":
        bad[D // 2] = np.inf
    else:  # within the bound until its last elements
        bad *= np.float32(0.5)
        bad[-10:] = 1e3
        max_norm = float(np.linalg.norm(a.astype(np.float64))) * 1.5
    expected, _ = _aggregate([Update("a", a, 3, 0), Update("b", b, 5, 0)], max_norm)
    got, verdicts = _aggregate([Update("a", a, 3, 0), Update("x", bad, 7, 0),
                                Update("b", b, 5, 0)], max_norm)
    assert [v.accepted for v in verdicts] == [True, False, True]
    np.testing.assert_array_equal(got, expected)  # bit for bit


def test_norm_and_mean_of_long_vectors():
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((3, D), dtype=np.float32)
    weights = [2, 3, 5]
    got, verdicts = _aggregate([Update(str(i), r, w, 0) for i, (r, w)
                                in enumerate(zip(rows, weights, strict=True))])
    for v, r in zip(verdicts, rows, strict=True):
        assert v.norm == pytest.approx(np.linalg.norm(r.astype(np.float64)), rel=1e-5)
    np.testing.assert_allclose(got, np.average(rows, axis=0, weights=weights), atol=1e-6)
    strided = rng.standard_normal(2 * D, dtype=np.float32)[::2]  # not contiguous
    got, [v] = _aggregate([Update("s", strided, 1, 0)])
    np.testing.assert_array_equal(got, strided)
    assert v.norm == pytest.approx(np.linalg.norm(strided.astype(np.float64)), rel=1e-5)


def test_aggregation_keeps_openblas_on_the_calling_thread():
    _aggregate([Update("a", np.ones(D, np.float32), 1, 0)])
    openblas = [lib for lib in threadpool_info() if lib["internal_api"] == "openblas"]
    assert openblas and all(lib["num_threads"] == 1 for lib in openblas)
