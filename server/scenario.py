"""The server's view of a resolved scenario: its typed sections, parsed once per run.

``simulations.config`` validates a scenario (every section, every cross-section rule) and
resolves it into the dict stored with the run; :meth:`ServerScenario.of` turns that dict
into the typed sections the server's parts take in their constructors, as Flower's
strategies take constructor arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aggregation.compression import CompressionConfig
from privacy.dp import DPConfig
from server.config import AggregationConfig, AuditConfig, FederationConfig
from server.cross_silo_config import GossipConfig, SiloConfig
from server.driver_config import ClientsConfig, DriverConfig
from server.secagg_config import SecAggScenarioConfig


@dataclass(frozen=True)
class ServerScenario:
    """The sections of a resolved scenario that the server uses, typed."""

    raw: Mapping[str, Any]  # the resolved scenario, as stored with the run
    seed: int
    federation: FederationConfig
    aggregation: AggregationConfig
    driver: DriverConfig
    dp: DPConfig
    secagg: SecAggScenarioConfig
    compression: CompressionConfig
    silo: SiloConfig
    gossip: GossipConfig
    audit: AuditConfig
    clients: ClientsConfig  # the simulated clients' speed and availability

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ServerScenario:
        """The typed sections of a resolved scenario (missing sections take defaults)."""
        def section(name: str) -> dict[str, Any]:
            return dict(config.get(name) or {})

        return cls(raw=config, seed=int(config.get("seed", 0)),
                   federation=FederationConfig(**section("federation")),
                   aggregation=AggregationConfig(**section("aggregation")),
                   driver=DriverConfig(**section("driver")),
                   dp=DPConfig.from_dict(section("dp")),
                   secagg=SecAggScenarioConfig.from_dict(section("secagg")),
                   compression=CompressionConfig(**section("compression")),
                   silo=SiloConfig(**section("silo")),
                   gossip=GossipConfig(**section("gossip")),
                   audit=AuditConfig(**section("audit")),
                   clients=ClientsConfig(**section("clients")))
