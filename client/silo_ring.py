"""Old names of the ring spec and digest, now in ``client.protocol.ring`` (the ring itself is
``client.silo.ring``); kept for the server's round drivers until they import
``client.protocol`` themselves."""

from __future__ import annotations

from client.protocol.ring import RingSpec, aggregate_digest

__all__ = ["RingSpec", "aggregate_digest"]
