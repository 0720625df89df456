"""The in-process engine and Flower's Ray simulation engine give the same model."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.cli import run_simulation


@pytest.mark.slow
def test_flower_engine_matches_inprocess_engine(small_config, db_url, store):
    a = run_simulation(small_config, engine="inprocess", db=db_url)
    b = run_simulation(small_config, engine="flower", db=db_url)
    assert a["versions"] == b["versions"] == 2
    pa = store.load_checkpoint(a["run_id"]).params
    pb = store.load_checkpoint(b["run_id"]).params
    # Same clients, seeds and aggregation order; only BLAS thread counts may differ.
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)
    assert abs(a["final_accuracy"] - b["final_accuracy"]) < 0.01


@pytest.mark.slow
def test_flower_engine_gives_the_same_federated_evaluation(small_config, db_url, store):
    """Every client evaluates after each round: the same answers (examples, loss,
    accuracy) and the same round figures on Ray as in process."""
    from server.spread import spread

    config = {**small_config,
              "federation": {**small_config["federation"], "evaluate_fraction": 1.0}}
    a = run_simulation(config, engine="inprocess", db=db_url)
    b = run_simulation(config, engine="flower", db=db_url)
    figures = []
    for run in (a, b):
        rounds = {r.round: r.metrics for r in store.rounds(run["run_id"]) if r.round > 0}
        answers = {}
        for rnd, e in store.evaluations(run["run_id"]):
            answers.setdefault(rnd, []).append(e)
        assert sorted(answers) == sorted(rounds) == [1, 2]
        for rnd, records in answers.items():
            assert [e.fate for e in records] == ["accepted"] * 5
            assert {k: rounds[rnd][k] for k in spread(records)} == spread(records)
        figures.append(({rnd: {k: v for k, v in m.items() if k.startswith("federated_")
                               and k != "federated_eval_s"} for rnd, m in rounds.items()},
                        {rnd: sorted((e.num_examples, e.accuracy, e.loss) for e in records)
                         for rnd, records in answers.items()}))
    (fig_a, ans_a), (fig_b, ans_b) = figures
    assert ans_a.keys() == ans_b.keys()
    for rnd in ans_a:  # node ids differ between the engines; the answers do not
        assert [n for n, *_ in ans_a[rnd]] == [n for n, *_ in ans_b[rnd]]
        np.testing.assert_allclose([fig for _, *fig in ans_a[rnd]],
                                   [fig for _, *fig in ans_b[rnd]], rtol=0, atol=1e-6)
        assert fig_a[rnd].keys() == fig_b[rnd].keys() and "federated_accuracy_p10" in fig_a[rnd]
        for key, value in fig_a[rnd].items():
            assert fig_b[rnd][key] == pytest.approx(value, abs=1e-6), (rnd, key)
    assert a["federated_accuracy"] == pytest.approx(b["federated_accuracy"], abs=1e-6)
