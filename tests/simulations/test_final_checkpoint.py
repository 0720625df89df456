"""The store's checkpoint holds the final model however the run ends: after the last round
when ``rounds`` is not a multiple of ``federation.checkpoint_every``, and after the round
at which a target stopped the run early."""

from __future__ import annotations

import numpy as np

from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario

FAST = ["federation.clients=3", "train.local_epochs=1", "data.partitioner=iid"]


def _checkpoints(db: str, run_id: str) -> tuple[list[int], int]:
    with Store(db) as store:
        ckpt = store.load_checkpoint(run_id)
        rounds = [r.round for r in store.rounds(run_id)]
        assert ckpt is not None
        return rounds, ckpt.round


def test_the_last_round_is_checkpointed_when_rounds_is_not_a_multiple(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=5",
                                       "federation.checkpoint_every=3"])
    summary = run_simulation(config, engine="inprocess", db=db)
    rounds, last = _checkpoints(db, summary["run_id"])
    assert rounds[-1] == 5 and last == 5
    with Store(db) as store:  # round 3's checkpoint is kept beside it
        assert store.load_checkpoint(summary["run_id"], round=3).round == 3


def test_a_run_stopped_by_its_target_checkpoints_the_round_it_stopped_after(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=9",
                                       "federation.checkpoint_every=4",
                                       "driver.target_accuracy=0.3"])
    summary = run_simulation(config, engine="inprocess", db=db)
    rounds, last = _checkpoints(db, summary["run_id"])
    assert rounds[-1] == 1 and last == 1  # the target is met after the first round
    with Store(db) as store:  # and it is the model the run ended with
        (run,) = store.list_runs()
        ckpt = store.load_checkpoint(summary["run_id"])
        assert run.num_rounds == 1 and np.isfinite(ckpt.params).all()


def test_checkpoint_every_zero_saves_none(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=2",
                                       "federation.checkpoint_every=0"])
    summary = run_simulation(config, engine="inprocess", db=db)
    with Store(db) as store:
        assert store.load_checkpoint(summary["run_id"]) is None
