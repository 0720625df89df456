"""Flower records of values this process made itself, filled without Flower's check of
each entry.

A ``MetricRecord``, ``ArrayRecord`` or ``RecordDict`` checks every key and value as it is
set (about 3 us an entry, a third of a reply's handling on a small model). A record
built here from values whose exact types are already what Flower accepts (``str`` keys;
``int`` or ``float`` metrics, never ``bool``; ``Array`` arrays; records in a
``RecordDict``) is an empty one of the same kind, copied the way Flower copies records,
with its entries put in at once: the same object Flower's constructor makes, and
anything else goes through that constructor. The receiver checks what it reads as
before (``server.replies``). If Flower's records change their layout
(``client.protocol.flower_compat``), every call takes the constructor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from client.protocol.flower_compat import array_from_fields, record_from_entries

_RECORD_TYPES = (ArrayRecord, MetricRecord, ConfigRecord)


def metric_record(values: Mapping[str, Any]) -> MetricRecord:
    """A MetricRecord of ``values``."""
    if all(type(k) is str and (type(v) is int or type(v) is float) for k, v in values.items()):
        record = record_from_entries(MetricRecord, values)
        if record is not None:
            return record
    return MetricRecord(dict(values))


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """An ArrayRecord of ``arrays``."""
    if all(type(k) is str and type(v) is Array for k, v in arrays.items()):
        record = record_from_entries(ArrayRecord, arrays)
        if record is not None:
            return record
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


def record_dict(records: Mapping[str, Any]) -> RecordDict:
    """A RecordDict of ``records``."""
    if all(type(k) is str and type(v) in _RECORD_TYPES for k, v in records.items()):
        record = record_from_entries(RecordDict, records)
        if record is not None:
            return record
    return RecordDict(dict(records))


def array(dtype: str, shape: tuple[int, ...], stype: str, data: Any) -> Array:
    """``Array(dtype, shape, stype, data)`` for ``data`` this process wrote (``bytes``, or a
    bytes-like buffer that never leaves the process: Flower's constructor accepts only
    ``bytes``, its attribute any value)."""
    if type(dtype) is str and type(stype) is str \
            and type(shape) is tuple and all(type(s) is int for s in shape):
        arr = array_from_fields(dtype, shape, stype, data)
        if arr is not None:
            return arr
    arr = Array(dtype=dtype, shape=shape, stype=stype, data=b"")
    arr.data = data
    return arr
