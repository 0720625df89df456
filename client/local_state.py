"""What a client keeps of its own model from round to round, in the node's ``Context.state``.

- Non-floating buffers (batch norm's ``num_batches_tracked``, int64) never enter the
  aggregated float32 vector: each client keeps its own count, exact, and continues it
  next round; a client that has none yet starts from the value the model was built with.
  The server's copy stays as built (it only evaluates, where the count is not used).
- With FedBN (``aggregation.local_buffers``, Li et al. ICLR 2021) the client also keeps
  every entry of ``Layout.local``: each batch-norm layer's weight, bias, running mean and
  variance, and any other buffer. It trains from its own values instead of the server's,
  and its delta is zero there, so the server averages none of them (secure aggregation
  and DP see the same full-length vector, zeros included). A client's first round starts
  from the server's values (the model as built).

``Context.state`` persists per node on every engine (the in-process engine's contexts,
Flower's simulation and SuperNodes), also where each message runs in a fresh process.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from client.flat_model import FlatModel
from client.protocol.npy import npy_array, npy_view

LOCAL_STATE = "fedring.local"  # Context.state: ArrayRecord of this node's own tensors


def local_spans(model: FlatModel) -> list[tuple[str, slice]]:
    """(name, span in the flat vector) of every entry FedBN keeps on the client."""
    layout = model.layout
    return [(name, slice(off, off + size)) for name, off, size, local
            in zip(layout.names, layout.offsets, layout.sizes, layout.local, strict=True)
            if local]


def _saved(record: object, name: str, like: np.ndarray | torch.Tensor) -> np.ndarray | None:
    """The saved array ``name`` if the record has it with ``like``'s shape and dtype."""
    if not isinstance(record, ArrayRecord) or name not in record:
        return None
    saved = npy_view(record[name])
    dtype = like.dtype if isinstance(like, np.ndarray) else \
        torch.empty((), dtype=like.dtype).numpy().dtype
    return saved if saved.shape == tuple(like.shape) and saved.dtype == dtype else None


def restore(state: RecordDict, model: FlatModel, fedbn: bool) -> None:
    """Put this node's own tensors into ``model``: the exact buffers (module tensors) and,
    with FedBN, the local entries of the host vector ``model.flat_np`` (before
    ``model.to_device``)."""
    if not model.exact and not fedbn:  # nothing of its own to put back
        return
    record = state.get(LOCAL_STATE)
    with torch.no_grad():
        for name, tensor in model.exact.items():
            saved = _saved(record, name, tensor)
            tensor.copy_(torch.from_numpy(np.array(saved)) if saved is not None
                         else model.exact_initial[name])
    if fedbn:
        views = model.layout.unflatten(model.flat_np)
        for name, _ in local_spans(model):
            saved = _saved(record, name, views[name])
            if saved is not None:
                views[name][...] = saved


def keep(state: RecordDict, model: FlatModel, fedbn: bool) -> None:
    """Save this node's own tensors after training (``model.flat_np`` refreshed)."""
    if not model.exact and not fedbn:
        return
    arrays = {name: npy_array(t.detach().cpu().numpy()) for name, t in model.exact.items()}
    if fedbn:
        views = model.layout.unflatten(model.flat_np)
        arrays.update({name: npy_array(views[name]) for name, _ in local_spans(model)})
    if arrays:
        state[LOCAL_STATE] = ArrayRecord(arrays)
