"""The Flower (Ray) engine of ``fedring simulate --engine flower``.

It runs the ServerApp and ClientApp objects through the Simulation Runtime that
``flwr run`` itself uses for a local simulation (``flwr-simulation`` calls
``flwr.simulation.run_simulation._run_simulation``), not through the deprecated
``flwr.simulation.run_simulation`` Python API, which only adds a deprecation warning in
front of the same call.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from simulations.engine_config import EngineConfig


def run_on_ray(server_app: ServerApp, client_app: ClientApp, *, num_supernodes: int,
               engine: EngineConfig) -> None:
    """Run ``server_app`` against ``num_supernodes`` virtual SuperNodes on Ray, each
    ClientApp with the CPUs and GPU share of ``engine``, on the cluster it names."""
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    _run_simulation(num_supernodes=num_supernodes, server_app=server_app,
                    client_app=client_app, backend_name="ray",
                    backend_config=engine.backend_config(),
                    exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE)
