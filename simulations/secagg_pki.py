"""A PKI for a simulated run: one SecAgg+ identity per node, every node trusting them all.

What ``fedring certs`` writes for a deployment, made in memory for the run: node
``partition-id = i`` gets identity ``i`` and the trusted keys of all, as text in its node
config (``SimulatedPKI.node_config``), which ``client.secagg_identity`` reads like the
files. In memory rather than in files, so that it reaches the ClientApps of both engines,
Ray workers on other machines included, and nothing is left behind after the run. The
in-process engine puts it in each node's config (``InProcessGrid(..., pki=...)``);
Flower's engine, whose node config holds only the partition, wraps the ClientApp
(:func:`with_pki`, ``run_on_ray(..., pki=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client.protocol.keys import NodeConfigKey
from privacy.secagg.identity import Identity, TrustedKeys


@dataclass(frozen=True)
class SimulatedPKI:
    """Each node's identity key (PEM text, by partition id) and the trusted keys' text."""

    identity_pems: tuple[str, ...]
    trusted_text: str

    def node_config(self, partition_id: int) -> dict[str, str]:
        """The node config entries that give partition ``partition_id`` its identity."""
        if not 0 <= partition_id < len(self.identity_pems):
            raise ValueError(f"the run's PKI has identities for partitions 0.."
                             f"{len(self.identity_pems) - 1}, not {partition_id}")
        return {NodeConfigKey.SECAGG_IDENTITY_PEM: self.identity_pems[partition_id],
                NodeConfigKey.SECAGG_TRUSTED_TEXT: self.trusted_text}


def make_pki(nodes: int) -> SimulatedPKI:
    """Fresh identities for ``nodes`` nodes (OS randomness, never the run seed: a key the
    server could derive would protect nothing)."""
    if nodes < 1:
        raise ValueError(f"a PKI needs at least one node, got {nodes}")
    identities = [Identity.generate() for _ in range(nodes)]
    trusted = TrustedKeys(identity.public for identity in identities)
    return SimulatedPKI(tuple(identity.to_pem().decode() for identity in identities),
                        trusted.to_text())


class _PKIClientApp(ClientApp):
    """A ClientApp that adds its node's PKI entries to the node config, then runs ``app``.
    Picklable as long as ``app`` is (Ray sends it to its workers)."""

    def __init__(self, app: ClientApp, pki: SimulatedPKI) -> None:
        super().__init__()
        self._app, self._pki = app, pki

    def __call__(self, message: Message, context: Context) -> Message:
        partition = context.node_config.get(NodeConfigKey.PARTITION_ID)
        if not isinstance(partition, int):
            raise ValueError(f"node config '{NodeConfigKey.PARTITION_ID}' must be an "
                             f"integer to pick the node's SecAgg+ identity, got {partition!r}")
        context.node_config.update(self._pki.node_config(partition))
        return self._app(message, context)


def with_pki(app: ClientApp | Any, pki: SimulatedPKI) -> ClientApp:
    """``app`` with each node's identity from ``pki`` in its node config (by partition id)."""
    return _PKIClientApp(app, pki)
