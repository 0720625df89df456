"""Worker momentum (Karimireddy, He, Jaggi, ICML 2021, "Learning from History for
Byzantine Robust Optimization"): with ``aggregation.client_momentum`` beta > 0 a client
sends ``m <- beta m + (1 - beta) delta`` instead of its delta, ``m`` its first delta at
the start. ``m`` lives in the node's ``Context.state``, so it persists from round to
round and starts again in a new run. The server combines these momenta (centered
clipping around the previous aggregate, which is then an aggregate of momenta) and
applies the result as it would apply a mean delta.

Averaging a client's deltas over rounds shrinks the honest inputs' spread around their
mean, so a clipping radius that follows that spread cuts attackers more. A client that
sits out rounds keeps its momentum from its last round (stale by those rounds).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from client.protocol.npy import npy_array, npy_view

MOMENTUM_STATE = "fedring.momentum"  # Context.state: ArrayRecord {"m": float32 vector}


def momentum_update(state: RecordDict, delta: np.ndarray, beta: float) -> np.ndarray:
    """Replace ``delta`` (in place) by this node's momentum after it, and keep that."""
    record = state.get(MOMENTUM_STATE)
    previous = npy_view(record["m"]) if isinstance(record, ArrayRecord) and "m" in record \
        else None
    if previous is not None and previous.shape == delta.shape:
        np.add(beta * previous.astype(np.float64), (1.0 - beta) * delta.astype(np.float64),
               out=delta, casting="unsafe")
    state[MOMENTUM_STATE] = ArrayRecord({"m": npy_array(delta)})
    return delta
