"""A centered-clipping run resumed from its checkpoint clips around the same centre and
ends where an uninterrupted run does: alone over buckets, and with every defence key on
(mixing, buckets from f, a scaled radius, fewer clipping iterations late), whose state is
the checkpointed centre and what follows from the seed and the model version."""

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


BASE = ["federation.clients=6", "federation.rounds=3", "train.local_epochs=1",
        "aggregation.combine=centered_clip", "federation.checkpoint_every=1"]
BUCKETS = ["aggregation.bucketing=2", "attack.fraction=0.34", "attack.kind=scale"]
EVERY_DEFENCE = ["attack.fraction=0.17", "attack.kind=sign_flip", "aggregation.f=1",
                 "aggregation.nnm=true", "aggregation.bucketing=-1",
                 "aggregation.clip_scale=1.5", "aggregation.clip_iterations_late=1",
                 "aggregation.clip_late_after=2"]
ARC_MOMENTUM_CENTRE = ["attack.fraction=0.17", "attack.kind=gaussian_noise", "aggregation.f=1",
                       "aggregation.nnm=true", "aggregation.arc=true",
                       "aggregation.server_opt=fedavgm", "aggregation.momentum=0.7",
                       "aggregation.clip_center=momentum"]


@pytest.mark.parametrize("overrides", [BUCKETS, EVERY_DEFENCE, ARC_MOMENTUM_CENTRE],
                         ids=["buckets", "every_key", "arc_momentum_centre"])
def test_resume_restores_the_centre(tmp_path, overrides):
    cfg = load_scenario("default", [*BASE, *overrides])
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
        grid = InProcessGrid(client_app, 6, threads="auto")  # as run_simulation's engine
        app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                          run_config={}))
    with Store(db) as store:
        crashed = next(r.run_id for r in store.list_runs() if r.run_id != clean["run_id"])
        ckpt = store.load_checkpoint(crashed)
        assert ckpt.round == 2 and "center" in ckpt.state["pipeline"]
    resumed = run_simulation(cfg, engine="inprocess", db=db, resume=crashed)
    assert resumed["rounds"] == 3 and resumed["versions"] == 3
    with Store(db) as store:
        a, b = store.load_checkpoint(clean["run_id"]), store.load_checkpoint(crashed)
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.state["pipeline"]["center"], b.state["pipeline"]["center"])
