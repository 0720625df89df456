"""Allreduce across silos over torch.distributed: ring, tree, halving-doubling, all-to-all,
round-robin, master-worker and native.

``allreduce(x, algorithm="ring")`` sums a tensor over a process group by
reduce-scatter then all-gather on point-to-point transfers, segmented and
pipelined; ``weighted_mean`` averages with per-rank weights in one allreduce.
Failures surface as :class:`RingError` / :class:`RingTimeout` instead of hangs.

The algorithm names and the errors import without torch; the collectives load it
on first use (``aggregation.ring.collective``).
"""

from __future__ import annotations

from typing import Any

from aggregation.ring.errors import RingError, RingTimeout
from aggregation.ring.names import ALGORITHMS

_COLLECTIVE = ("DEFAULT_SEGMENT_BYTES", "DEFAULT_WINDOW", "allreduce", "weighted_mean")

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_WINDOW",
    "RingError",
    "RingTimeout",
    "allreduce",
    "weighted_mean",
]


def __getattr__(name: str) -> Any:
    """The torch-backed names, imported when first asked for."""
    if name in _COLLECTIVE:
        from aggregation.ring import collective

        return getattr(collective, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
