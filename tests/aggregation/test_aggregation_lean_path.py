"""The lean submit path: same verdicts and bit-identical aggregates as the staged path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from aggregation import (
    Hinge,
    Pipeline,
    Polynomial,
    Update,
    Validate,
    Weight,
    WeightedMean,
    WeightedSum,
)
from aggregation.pipeline import RoundAggregation
from aggregation.robust import CoordinateMedian
from simulations.config import load_scenario

DIM = 4
VERSION = 6


class StagedValidate(Validate):
    """Validate under another type: the aggregation runs every stage in turn."""


def _deltas() -> st.SearchStrategy:
    finite = arrays(np.float32, DIM, elements=st.floats(-1e3, 1e3, width=32))
    hostile = arrays(np.float32, DIM, elements=st.one_of(
        st.floats(-1e3, 1e3, width=32), st.sampled_from([np.nan, np.inf, -np.inf, 3e38])))
    strided = arrays(np.float32, 2 * DIM, elements=st.floats(-10, 10, width=32)).map(
        lambda a: a[::2])
    other = st.one_of(arrays(np.float64, DIM), arrays(np.float32, DIM + 1),
                      arrays(np.float32, (DIM, 1)), st.none())
    return st.one_of(finite, finite, hostile, strided, other)


_updates = st.lists(st.builds(
    Update, client_id=st.sampled_from("abcdef"), delta=_deltas(),
    num_examples=st.one_of(st.integers(1, 500), st.integers(1, 500).map(np.int64),
                           st.integers(-2, 0), st.booleans(), st.just(2**63)),
    base_version=st.one_of(st.integers(0, VERSION), st.integers(0, VERSION).map(np.int32),
                           st.integers(VERSION + 1, VERSION + 2), st.just(-1), st.none()),
), max_size=8)


def _run(validate: Validate, weight: Weight | None, combine, updates: list[Update]):
    stages = [validate] if weight is None else [validate, weight]
    agg = Pipeline(*stages, combine).open_round(dim=DIM, version=VERSION)
    lean = agg.lean
    verdicts = [agg.submit(u) for u in updates]
    return agg, lean, verdicts, agg.finish()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(updates=_updates,
       max_norm=st.one_of(st.none(), st.floats(1.0, 3000.0)),
       max_staleness=st.one_of(st.none(), st.integers(0, VERSION)),
       weight=st.sampled_from([None, Weight("examples"), Weight("uniform"),
                               Weight("examples", Polynomial(0.5)),
                               Weight("uniform", Hinge(2, 1))]),
       combine=st.sampled_from([WeightedMean, WeightedSum, CoordinateMedian]))
def test_lean_and_staged_paths_agree(updates, max_norm, max_staleness, weight, combine):
    lean, was_lean, lean_verdicts, lean_result = _run(
        Validate(max_norm, max_staleness), weight, combine(), updates)
    staged, was_staged, staged_verdicts, staged_result = _run(
        StagedValidate(max_norm, max_staleness), weight, combine(), updates)
    assert was_lean and not was_staged and not lean.lean  # finished: no lean path left
    # repr: a NaN norm equals itself there
    assert [repr(v) for v in lean_verdicts] == [repr(v) for v in staged_verdicts]
    assert lean.verdicts == lean_verdicts
    assert (lean.total_weight, lean.num_accepted) == (staged.total_weight, staged.num_accepted)
    if staged_result is None:
        assert lean_result is None
    else:
        np.testing.assert_array_equal(lean_result, staged_result)  # bit for bit


def test_a_rejected_first_update_leaves_no_trace() -> None:
    """The accumulator is not zeroed at start: the first accepted update writes it whole."""
    good = np.array([1.5, -2.0, 0.25, 8.0], dtype=np.float32)
    for first in (np.full(DIM, np.nan, np.float32), np.full(DIM, 1e30, np.float32)):
        agg = Pipeline(Validate(max_norm=100.0), Weight("examples"),
                       WeightedMean()).open_round(dim=DIM, version=0)
        assert not agg.submit(Update("x", first, 3, 0)).accepted
        assert agg.submit(Update("a", good, 4, 0)).accepted  # 4 and 1/4: exact
        np.testing.assert_array_equal(agg.finish(), good)


def test_weighted_sum_of_lean_updates_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((5, 1000), dtype=np.float32)
    agg = Pipeline(Validate(), Weight("examples"), WeightedSum()).open_round(dim=1000,
                                                                              version=0)
    for i, row in enumerate(rows):
        assert agg.submit(Update(str(i), row, i + 1, 0)).accepted
    expected = (np.arange(1, 6, dtype=np.float64)[:, None] * rows).sum(axis=0)
    np.testing.assert_allclose(agg.finish(), expected, rtol=1e-5, atol=1e-4)


def test_lean_path_needs_exactly_validate_then_weight() -> None:
    def lean(*stages) -> bool:
        return Pipeline(*stages, WeightedMean()).open_round(dim=3, version=0).lean

    assert lean(Validate(), Weight()) and lean(Validate())
    assert not lean(Weight(), Validate()) and not lean(Weight()) and not lean()
    assert not lean(StagedValidate(), Weight())
    assert not Pipeline(Validate(), WeightedMean()).open_round(dim=0, version=0).lean


def test_weighted_mean_add_before_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="start"):
        WeightedMean().add(np.ones(3, np.float32), 1.0)


def test_updates_of_a_real_round_take_the_lean_path(run_inprocess, monkeypatch) -> None:
    """Decoded replies of fedring's ClientApp pass every check of the lean path."""
    staged: list[str] = []
    accepted: list[str] = []
    submit, submit_staged = RoundAggregation.submit, RoundAggregation._submit_staged

    def counting_submit(self, update):
        verdict = submit(self, update)
        if verdict.accepted:
            accepted.append(update.client_id)
        return verdict

    def counting_staged(self, update, norm=None):
        staged.append(update.client_id)
        return submit_staged(self, update, norm)

    monkeypatch.setattr(RoundAggregation, "submit", counting_submit)
    monkeypatch.setattr(RoundAggregation, "_submit_staged", counting_staged)
    config = load_scenario("default", ["federation.clients=4", "federation.rounds=1",
                                       "train.local_epochs=1"])
    summary = run_inprocess(config)
    assert summary["rounds"] == 1
    assert len(accepted) == 4 and staged == []
