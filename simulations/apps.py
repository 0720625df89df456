"""The fedring ServerApp and ClientApp bound to the scenario task.

``flwr run .`` loads ``server_app`` and ``client_app`` from here (see pyproject.toml);
``fedring simulate`` runs the very same apps on its in-process engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client.app import make_client_app
from server.app import NODES_KEY, make_server_app
from simulations.attacks import omniscient_attack
from simulations.config import load_scenario
from simulations.module_task import make_task
from simulations.task import task_spec
from simulations.tracking import open_tracking

RESERVED_RUN_CONFIG = ("scenario", "overrides", "resume", "db", "name")


def config_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved scenario from a Flower run config.

    ``scenario`` names the scenario, ``overrides`` holds ``section.key=value`` pairs
    separated by commas or spaces (``flwr run . --run-config 'overrides="federation.rounds=3"'``),
    and any dotted ``section.key`` entry is applied as a typed override too. Where neither
    sets ``federation.clients``, the ServerApp's count of connected nodes (``NODES_KEY``)
    does. ``name`` names the run (``--name``).
    """
    raw = str(run_config.get("overrides", "")).replace(",", " ").split()
    values = {k: v for k, v in run_config.items() if k not in RESERVED_RUN_CONFIG and "." in k}
    nodes = run_config.get(NODES_KEY)  # the ServerApp's count of connected nodes
    if nodes and "federation.clients" not in values and not any(
            o.split("=", 1)[0].strip() == "federation.clients" for o in raw):
        values["federation.clients"] = int(nodes)
    return load_scenario(str(run_config.get("scenario", "default")), raw, values=values,
                         name=str(run_config.get("name") or "") or None)


def spec_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    return task_spec(config_from_run_config(run_config))


def build_task(config: Mapping[str, Any]) -> Any:
    """The scenario's task (built-in, or the user's ``[task] module``), checked."""
    task = make_task(task_spec(config))
    task.check(config)
    return task


def run_pki(config: Mapping[str, Any]) -> Any:
    """A simulated run's SecAgg+ PKI (``simulations.secagg_pki``): one identity per client
    when the scenario runs secure aggregation with ``secagg.security = "malicious"``, else
    None (a semi-honest run's nodes need no identity, and get none)."""
    secagg = config.get("secagg") or {}
    if not secagg.get("enabled") or secagg.get("security") != "malicious":
        return None
    from simulations.secagg_pki import make_pki

    return make_pki(int(config["federation"]["clients"]))


def cohort_hook(vectorize: Any) -> Any:
    """The in-process engine's cohort hook for ``engine.vectorize`` (``client.vectorized``)."""
    from client.app import FedringClient
    from client.vectorized import CohortHook

    return CohortHook(FedringClient(make_task, spec_from_run_config), vectorize)


server_app = make_server_app(build_task, config_from_run_config, observe=open_tracking,
                             pre_combine=omniscient_attack)
client_app = make_client_app(make_task, spec_from_run_config)
