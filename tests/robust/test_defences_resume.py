"""A run with every new defence key on (mixing, buckets from f, a scaled radius, fewer
clipping iterations late) resumed from its checkpoint ends where an uninterrupted run
does: the centre is checkpointed, the rest follows from the seed and the model version."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from server.app import make_server_app
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.attacks import omniscient_attack
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid


class Crash(Exception):
    pass


def test_resume_with_every_defence_key(tmp_path):
    cfg = load_scenario("default", [
        "federation.clients=6", "federation.rounds=3", "train.local_epochs=1",
        "federation.checkpoint_every=1", "attack.fraction=0.17", "attack.kind=sign_flip",
        "aggregation.combine=centered_clip", "aggregation.f=1", "aggregation.nnm=true",
        "aggregation.bucketing=-1", "aggregation.clip_scale=1.5",
        "aggregation.clip_iterations_late=1", "aggregation.clip_late_after=2"])
    db = f"sqlite:///{tmp_path / 'store.db'}"
    clean = run_simulation(cfg, engine="inprocess", db=db)

    def crashing_task(config):  # evaluations: round 0, 1, 2, then round 3 fails
        task = build_task(config)
        evaluate, calls = task.evaluate, []

        def failing(params):
            calls.append(1)
            if len(calls) == 4:
                raise Crash
            return evaluate(params)

        task.evaluate = failing
        return task

    app = make_server_app(crashing_task, config_from_run_config, config=cfg, store_url=db,
                          pre_combine=omniscient_attack)
    with pytest.raises(Crash):
        app(InProcessGrid(client_app, 6), Context(run_id=1, node_id=0, node_config={},
                                                  state=RecordDict(), run_config={}))
    with Store(db) as store:
        crashed = next(r.run_id for r in store.list_runs() if r.run_id != clean["run_id"])
        assert store.load_checkpoint(crashed).round == 2
    resumed = run_simulation(cfg, engine="inprocess", db=db, resume=crashed)
    assert resumed["rounds"] == 3 and resumed["versions"] == 3
    with Store(db) as store:
        a, b = store.load_checkpoint(clean["run_id"]), store.load_checkpoint(crashed)
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.state["pipeline"]["center"], b.state["pipeline"]["center"])
