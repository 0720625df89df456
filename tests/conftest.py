"""Fixtures shared by the end-to-end suites: a SQLite store and the real apps in process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from server.app import make_server_app
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.attacks import omniscient_attack
from simulations.heterogeneity import make_clock
from simulations.inprocess import InProcessGrid

RunInProcess = Callable[..., dict[str, Any]]


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'runs' / 'fedring.db'}"


@pytest.fixture
def store(db_url: str):
    s = Store(db_url)
    yield s
    s.close()


@pytest.fixture
def run_inprocess(db_url: str) -> RunInProcess:
    """Run fedring's ServerApp on the in-process engine with any ClientApp (default fedring's).

    ``simulated`` puts the drivers on the simulated clock; ``grid`` replaces the engine;
    ``models`` collects every model the server evaluates (version 0, then each round).
    """

    def _run(config: dict[str, Any], app: ClientApp | None = None, *, simulated: bool = False,
             grid: InProcessGrid | None = None,
             models: list[np.ndarray] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = {}

        def task_builder(cfg: dict[str, Any]) -> Any:
            task = build_task(cfg)
            if models is not None:
                evaluate = task.evaluate
                task.evaluate = lambda p: (models.append(p.copy()), evaluate(p))[1]
            return task

        server_app = make_server_app(task_builder, config_from_run_config, config=config,
                                     store_url=db_url, on_summary=result.update,
                                     clock=make_clock if simulated else None,
                                     pre_combine=omniscient_attack)
        grid = grid or InProcessGrid(app or client_app, config["federation"]["clients"])
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                 run_config={}))
        return result

    return _run
