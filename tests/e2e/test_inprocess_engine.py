"""The default engine end to end: real ServerApp, real ClientApp, real SQLite store."""

from __future__ import annotations

import numpy as np

from simulations.task import ScenarioTask


def test_small_run_trains_and_records_everything(small_config, run_inprocess, store):
    summary = run_inprocess(small_config)
    assert summary["rounds"] == 2 and summary["versions"] == 2
    run = store.get_run(summary["run_id"])
    assert run.status == "completed"
    assert run.config["federation"]["clients"] == 5
    rounds = store.rounds(summary["run_id"])
    assert [r.round for r in rounds] == [0, 1, 2]
    # training helps: accuracy after 2 rounds is far above the untrained model's
    assert rounds[-1].metrics["accuracy"] > rounds[0].metrics["accuracy"] + 0.3
    assert summary["final_accuracy"] == rounds[-1].metrics["accuracy"]
    for r in rounds[1:]:
        assert (r.num_sampled, r.num_replies, r.num_accepted) == (5, 5, 5)
        updates = store.updates(summary["run_id"], round=r.round)
        assert len(updates) == 5
        assert all(u.fate == "accepted" and u.num_examples > 0 and u.norm > 0
                   for _, u in updates)
        task = ScenarioTask.from_config(small_config)
        held_out = sum(len(task.client_test(pid)[1]) for pid in range(5))
        assert sum(u.num_examples for _, u in updates) + held_out == len(task.dataset.y_train)
    ckpt = store.load_checkpoint(summary["run_id"])
    assert ckpt is not None and ckpt.round == 2 and ckpt.model_version == 2


def test_same_seed_same_model_and_other_seed_differs(small_config, run_inprocess, store):
    a = run_inprocess(small_config)
    b = run_inprocess(small_config)
    pa = store.load_checkpoint(a["run_id"]).params
    pb = store.load_checkpoint(b["run_id"]).params
    np.testing.assert_array_equal(pa, pb)
    other = dict(small_config, seed=small_config["seed"] + 1)
    c = run_inprocess(other)
    assert not np.allclose(store.load_checkpoint(c["run_id"]).params, pa)


def test_partial_participation_samples_per_round(small_config, run_inprocess, store):
    cfg = {**small_config, "federation": {**small_config["federation"],
                                          "sample_fraction": 0.4, "min_clients": 2}}
    summary = run_inprocess(cfg)
    sampled = [{u.client_id for _, u in store.updates(summary["run_id"], round=r)}
               for r in (1, 2)]
    assert [len(s) for s in sampled] == [2, 2]


def test_robust_combine_runs_end_to_end(small_config, run_inprocess, store):
    cfg = {**small_config, "aggregation": {**small_config["aggregation"],
                                           "combine": "trimmed_mean", "trim_beta": 0.2}}
    summary = run_inprocess(cfg)
    assert summary["versions"] == 2
    assert store.get_run(summary["run_id"]).config["aggregation"]["combine"] == "trimmed_mean"
    assert summary["final_accuracy"] > 0.5
