"""The server's view of DP-SGD: the clients' composed figures, the budget stop, a resume."""

from __future__ import annotations

import dp_accounting
import pytest

from server.dp_sgd import DPSGDLedger
from server.store import UpdateRecord

TRAIN = {"dp_sgd_noise_multiplier": 1.0, "dp_sgd_delta": 1e-5}


def _epsilon(q: float, steps: int) -> float:
    """dp_accounting: ``steps`` Poisson-sampled Gaussians at z = 1, add/remove one example."""
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)),
                steps)
    return acc.get_epsilon(1e-5)


def _record(client: str, q: float, steps: int, rounds: int) -> UpdateRecord:
    return UpdateRecord(client_id=client, fate="accepted", metrics={
        "dp_sgd_epsilon": _epsilon(q, steps * rounds),
        "dp_sgd_epsilon_next": _epsilon(q, steps * (rounds + 1)),
        "dp_sgd_rounds": float(rounds), "dp_sgd_sample_rate": q,
        "dp_sgd_round_steps": float(steps)})


def test_the_round_figure_is_the_largest_and_the_stop_uses_the_next_round():
    small, large = _record("1", 0.5, 2, 2), _record("2", 0.1, 10, 1)
    figures = [small.metrics, large.metrics]
    budget = max(m["dp_sgd_epsilon"] for m in figures) * 1.0001  # spent fits, next does not
    ledger = DPSGDLedger({**TRAIN, "dp_sgd_epsilon_budget": budget})
    metrics = ledger.observe([small, large, UpdateRecord("3", "rejected", reason="refused")])
    assert metrics == {"dp_sgd_epsilon": max(m["dp_sgd_epsilon"] for m in figures)}
    assert "train.dp_sgd_epsilon_budget" in ledger.over_budget()
    assert DPSGDLedger({**TRAIN, "dp_sgd_epsilon_budget": 1e6}).over_budget() is None


def test_no_reported_figure_is_none_in_the_summary_not_zero():
    ledger = DPSGDLedger(TRAIN)
    assert ledger.observe([UpdateRecord("1", "accepted")]) == {}
    assert ledger.summary()["dp_sgd_epsilon"] is None
    assert DPSGDLedger({}).summary() == {}  # DP-SGD off: no entries


def test_a_resume_tells_clients_the_most_rounds_plus_one_and_predicts_from_there():
    ledger = DPSGDLedger({**TRAIN, "dp_sgd_epsilon_budget": 50.0})
    ledger.restore([_record("1", 0.5, 2, 1), _record("1", 0.5, 2, 2), _record("2", 0.1, 10, 1)])
    assert ledger.prior_rounds == 3  # two rounds reported, one more may have gone unrecorded
    # the next round of a client that forgot its state composes prior_rounds + 1 rounds
    assert ledger.next == pytest.approx(max(_epsilon(0.5, 2 * 4), _epsilon(0.1, 10 * 4)),
                                        rel=1e-9)
    assert ledger.summary()["dp_sgd_epsilon"] == pytest.approx(_epsilon(0.5, 4), rel=1e-9)
