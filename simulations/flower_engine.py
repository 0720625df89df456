"""The Flower (Ray) engine of ``fedring simulate --engine flower``.

It runs the ServerApp and ClientApp objects through the Simulation Runtime that
``flwr run`` itself uses for a local simulation
(``client.protocol.flower_compat.run_simulation``), not through the deprecated
``flwr.simulation.run_simulation`` Python API, which only adds a deprecation warning in
front of the same call.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from client.protocol.flower_compat import run_simulation
from simulations.engine_config import EngineConfig
from simulations.secagg_pki import SimulatedPKI, with_pki


def run_on_ray(server_app: ServerApp, client_app: ClientApp, *, num_supernodes: int,
               engine: EngineConfig, pki: SimulatedPKI | None = None) -> None:
    """Run ``server_app`` against ``num_supernodes`` virtual SuperNodes on Ray, each
    ClientApp with the CPUs and GPU share of ``engine``, on the cluster it names; with
    ``pki``, each node's SecAgg+ identity in its node config (default none)."""
    if pki is not None:
        client_app = with_pki(client_app, pki)
    run_simulation(server_app, client_app, num_supernodes=num_supernodes,
                   backend_name="ray", backend_config=engine.backend_config())
