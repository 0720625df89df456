"""Models and deltas in messages: the model as Flower's per-layer ArrayRecord, a delta
as one flat float32 Array under "delta"."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from aggregation.flat import Layout
from client.protocol.errors import WireError
from client.protocol.keys import RecordName
from client.protocol.npy import npy_array, npy_view, shared_array
from client.protocol.records import array_record


def model_record(layout: Layout, params: np.ndarray) -> ArrayRecord:
    """The model as Flower expects it: one Array per named tensor."""
    return array_record({name: npy_array(view)
                         for name, view in layout.unflatten(params).items()})


def model_views(record: ArrayRecord, layout: Layout) -> dict[str, np.ndarray]:
    """Zero-copy views of a per-layer model record, checked against the layout's names
    and float dtypes (shapes are checked when they are flattened).

    Integer tensors the layout does not hold are left out: they are buffers that each
    client keeps for itself (batch norm's ``num_batches_tracked``, which a stock Flower
    client sends with its state dict), never averaged.
    """
    if not isinstance(record, ArrayRecord):
        raise WireError(f"expected an ArrayRecord, got {type(record).__name__}")
    names = {name for name in record
             if name in layout.names or not _integer(record[name].dtype)}
    if names != set(layout.names):
        expected = set(layout.names)
        missing = [n for n in layout.names if n not in names]
        extra = [n for n in record if n in names and n not in expected]
        raise WireError(f"model tensors do not match the model's: missing {_listed(missing)}; "
                        f"unexpected {_listed(extra)}")
    arrays = {name: npy_view(record[name]) for name in layout.names}
    for name, a in arrays.items():
        if a.dtype.kind != "f":  # a floating type
            raise WireError(f"tensor '{name}' has dtype {a.dtype}, expected a float type")
    return arrays


def _integer(dtype: str) -> bool:
    try:
        return np.dtype(dtype).kind in "iub"
    except TypeError:
        return False


def _listed(names: list[str], limit: int = 12) -> str:
    """Tensor names for a message: the first ``limit``, then how many more."""
    shown = ", ".join(repr(n)[1:-1][:80] for n in names[:limit]) or "none"
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def flatten_model(views: Mapping[str, np.ndarray], layout: Layout,
                  out: np.ndarray) -> np.ndarray:
    """Copy checked model views into the flat vector ``out`` (one copy in total)."""
    try:
        return layout.flatten(views, out=out)
    except ValueError as exc:
        raise WireError(str(exc)) from exc


def read_model(record: ArrayRecord, layout: Layout, out: np.ndarray) -> np.ndarray:
    """Copy a per-layer model record into the flat vector ``out`` (one copy in total)."""
    return flatten_model(model_views(record, layout), layout, out)


def delta_record(delta: np.ndarray) -> ArrayRecord:
    """A client's flat float32 delta as a one-Array record (sharing, not copying, a delta
    that fills a ReplyBuffers buffer)."""
    return array_record({RecordName.DELTA: shared_array(delta) or npy_array(delta)})


def read_delta(record: ArrayRecord) -> np.ndarray:
    """The flat delta of a fedring reply (a read-only view; validated by the pipeline)."""
    if not isinstance(record, ArrayRecord) or RecordName.DELTA not in record:
        raise WireError("reply has no 'delta' array")
    if len(record) != 1:
        raise WireError(f"delta record has {len(record)} arrays, expected 1")
    return npy_view(record[RecordName.DELTA]).reshape(-1)
