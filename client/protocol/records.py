"""Flower records of values this process made itself, filled without Flower's check of
each entry.

A ``MetricRecord``, ``ArrayRecord`` or ``RecordDict`` checks every key and value as it is
set (about 3 us an entry, a third of a reply's handling on a small model). A record
built here from values whose exact types are already what Flower accepts (``str`` keys;
``int`` or ``float`` metrics, never ``bool``; ``Array`` arrays; records in a
``RecordDict``) is an empty one of the same kind, copied the way Flower copies records,
with its entries put in at once: the same object Flower's constructor makes, and
anything else goes through that constructor. The receiver checks what it reads as
before (``server.replies``). If Flower's records stop keeping their entries in a
``_data`` dict, every call takes the constructor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

R = TypeVar("R", MetricRecord, ArrayRecord, RecordDict)

_RECORD_TYPES = (ArrayRecord, MetricRecord, ConfigRecord)
_ARRAY_FIELDS = ("dtype", "shape", "stype", "data")


def _empty(kind: type[R]) -> R | None:
    """An empty ``kind`` whose entries live in a ``_data`` dict that ``copy`` copies."""
    empty = kind()
    copy = getattr(empty, "copy", None)
    data = empty.__dict__.get("_data")
    if copy is None or not isinstance(data, dict) or copy().__dict__.get("_data") is data:
        return None
    return empty


_EMPTY: dict[type, Any] = {kind: _empty(kind) for kind in (MetricRecord, ArrayRecord, RecordDict)}


def _filled(kind: type[R], entries: Mapping[str, Any]) -> R | None:
    empty = _EMPTY[kind]
    if empty is None:
        return None
    record = empty.copy()
    record.__dict__["_data"] = dict(entries)
    return record


def metric_record(values: Mapping[str, Any]) -> MetricRecord:
    """A MetricRecord of ``values``."""
    if all(type(k) is str and (type(v) is int or type(v) is float) for k, v in values.items()):
        record = _filled(MetricRecord, values)
        if record is not None:
            return record
    return MetricRecord(dict(values))


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """An ArrayRecord of ``arrays``."""
    if all(type(k) is str and type(v) is Array for k, v in arrays.items()):
        record = _filled(ArrayRecord, arrays)
        if record is not None:
            return record
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


def record_dict(records: Mapping[str, Any]) -> RecordDict:
    """A RecordDict of ``records``."""
    if all(type(k) is str and type(v) in _RECORD_TYPES for k, v in records.items()):
        record = _filled(RecordDict, records)
        if record is not None:
            return record
    return RecordDict(dict(records))


def _array_layout_known() -> bool:
    """Whether Flower's Array keeps exactly its four fields in ``__dict__`` (lazily adding
    its dirty flag and caches), so that setting them there makes the constructor's object."""
    probe = Array("float32", (1,), "numpy.ndarray", b"\0" * 4)
    return set(probe.__dict__) - {"_is_dirty"} == set(_ARRAY_FIELDS)


_ARRAY_LAYOUT_KNOWN = _array_layout_known()


def array(dtype: str, shape: tuple[int, ...], stype: str, data: Any) -> Array:
    """``Array(dtype, shape, stype, data)`` for ``data`` this process wrote (``bytes``, or a
    bytes-like buffer that never leaves the process: Flower's constructor accepts only
    ``bytes``, its attribute any value)."""
    if _ARRAY_LAYOUT_KNOWN and type(dtype) is str and type(stype) is str \
            and type(shape) is tuple and all(type(s) is int for s in shape):
        arr = object.__new__(Array)
        arr.__dict__.update(dtype=dtype, shape=shape, stype=stype, data=data)
        return arr
    arr = Array(dtype=dtype, shape=shape, stype=stype, data=b"")
    arr.data = data
    return arr
