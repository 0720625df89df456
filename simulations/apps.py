"""The fedring ServerApp and ClientApp bound to the scenario task.

``flwr run .`` loads ``server_app`` and ``client_app`` from here (see pyproject.toml);
``fedring simulate`` runs the very same apps on its in-process engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client.app import make_client_app
from server.app import make_server_app
from simulations.config import load_scenario
from simulations.task import ScenarioTask, task_spec

RESERVED_RUN_CONFIG = ("scenario", "overrides", "resume", "db")


def config_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved scenario from a Flower run config.

    ``scenario`` names the scenario, ``overrides`` holds ``section.key=value`` pairs
    separated by commas or spaces (``flwr run . --run-config 'overrides="federation.rounds=3"'``),
    and any dotted ``section.key`` entry is applied as a typed override too.
    """
    raw = str(run_config.get("overrides", "")).replace(",", " ").split()
    values = {k: v for k, v in run_config.items() if k not in RESERVED_RUN_CONFIG and "." in k}
    return load_scenario(str(run_config.get("scenario", "default")), raw, values=values)


def spec_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    return task_spec(config_from_run_config(run_config))


def build_task(config: Mapping[str, Any]) -> ScenarioTask:
    task = ScenarioTask.from_config(config)
    task.check()
    return task


def cohort_hook(vectorize: Any) -> Any:
    """The in-process engine's cohort hook for ``engine.vectorize`` (None when false)."""
    if vectorize is False:
        return None
    from client.app import FedringClient
    from client.vectorized import VectorizedCohorts

    return VectorizedCohorts(FedringClient(ScenarioTask, spec_from_run_config), vectorize)


server_app = make_server_app(build_task, config_from_run_config)
client_app = make_client_app(ScenarioTask, spec_from_run_config)
