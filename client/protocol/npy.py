"""Flower Arrays in .npy format: one copy to encode, a zero-copy view to decode.

Encoding writes the .npy header and the raw bytes in one copy; decoding is a zero-copy
``np.frombuffer`` view after checking the header. Headers are parsed and written once per
distinct (dtype, shape): a model sends the same ones every round, and numpy's parser
(a Python literal) costs about 0.1 ms each.

On the in-process engine (node config ``NodeConfigKey.IN_PROCESS``) a client's delta
reply is not copied at all: the client trains, subtracts straight into a reusable .npy
buffer (:class:`ReplyBuffers`) and the reply's Array points at it, since it never leaves
the process.
"""

from __future__ import annotations

import functools
import io
import math
import sys
import tokenize
from typing import Any

import numpy as np
from flwr.app import Array

from client.protocol.errors import WireError
from client.protocol.records import array

NPY_STYPE = "numpy.ndarray"


@functools.lru_cache(maxsize=256)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy (1.0) header of a C-contiguous array."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                "fortran_order": False, "shape": shape})
    return head.getvalue()


_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}  # parsed, by their bytes
_MAX_HEADERS = 1024  # distinct headers remembered (a hostile sender cannot grow it further)
_MAX_HEADER_BYTES = 16_384  # numpy refuses headers over 10,000 bytes anyway


def _read_header(data: Any) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran, dtype, payload offset) of .npy bytes: magic (6 bytes), version (2),
    the header's length (2 bytes in version 1, else 4), then the header. Only a header
    numpy parsed is remembered, so a remembered one (magic included) is known good."""
    view = memoryview(data).cast("B")
    width = 2 if len(view) > 6 and view[6] == 1 else 4
    end = min(8 + width + int.from_bytes(view[8:8 + width], "little"), _MAX_HEADER_BYTES)
    key = view[:end].tobytes()
    parsed = _HEADERS.get(key)
    if parsed is None:
        fp = io.BytesIO(key)
        major, _ = np.lib.format.read_magic(fp)  # a bad magic string raises here
        reader = (np.lib.format.read_array_header_1_0 if major == 1
                  else np.lib.format.read_array_header_2_0)
        parsed = reader(fp)
        if len(_HEADERS) < _MAX_HEADERS:
            _HEADERS[key] = parsed
    return (*parsed, end)


def npy_array(a: np.ndarray) -> Array:
    """A Flower Array holding ``a`` in .npy format, written with a single copy."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        a = np.ascontiguousarray(a)
    shape = tuple(int(s) for s in a.shape)
    payload = memoryview(a).cast("B") if a.size else b""  # (memoryview refuses 0 sizes)
    data = b"".join((_npy_header(a.dtype, shape), payload))
    return array(str(a.dtype), shape, NPY_STYPE, data)


class ReplyBuffers:
    """Reusable .npy buffers for delta replies that never leave this process.

    ``delta(dim)`` is a writable float32 vector inside a buffer that already holds its
    .npy header; ``delta_record`` then makes that buffer the reply's Array data instead of
    copying it into fresh bytes (whose page faults cost more than the copy). A buffer is
    reused only once nothing refers to it any more (CPython's reference count: the server
    dropped the reply and every view of it), so a reply that is kept, e.g. by a robust
    combine, is never overwritten; a new buffer is made instead. Only for replies that
    stay in the process: Flower's transports expect ``bytes``.
    """

    _UNUSED = 2  # references to a buffer nobody uses: our list's and getrefcount's argument

    def __init__(self, keep: int = 4) -> None:
        self._buffers: list[_ReplyBuffer] = []
        self._keep = keep

    def delta(self, dim: int) -> np.ndarray:
        """A writable float32 vector of length ``dim`` in a buffer nothing else uses."""
        header = _npy_header(np.dtype(np.float32), (dim,))
        size = len(header) + 4 * dim
        free = [i for i in range(len(self._buffers)) if len(self._buffers[i]) == size
                and sys.getrefcount(self._buffers[i]) == self._UNUSED]
        if free:
            buf = self._buffers[free[0]]
        else:
            buf = _ReplyBuffer(size)
            if len(self._buffers) >= self._keep:
                self._buffers.pop(0)
            self._buffers.append(buf)
        buf[:len(header)] = header
        return np.frombuffer(buf, np.float32, count=dim, offset=len(header))

    def unused_but_for(self, arr: np.ndarray) -> bool:
        """Whether ``arr``, a vector from :meth:`delta`, is the only thing left that refers
        to its buffer: no reply carries the buffer and no view of one is alive, so ``arr``
        may be written again."""
        view = arr.base
        if not (isinstance(view, memoryview) and isinstance(view.obj, _ReplyBuffer)):
            return False
        buf = view.obj
        # the buffer's references: our list, ``arr``'s memoryview, ``buf`` and
        # getrefcount's argument (a reply's Array or a view made from it adds one)
        if sys.getrefcount(buf) != 4:
            return False
        return any(b is buf for b in self._buffers)


class _ReplyBuffer(bytearray):
    """A .npy header and a float32 vector, owned by a ReplyBuffers."""


def shared_array(delta: np.ndarray) -> Array | None:
    """An Array whose data is the ReplyBuffers buffer ``delta`` fills (no copy), else None."""
    base = delta.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, _ReplyBuffer)
            and delta.dtype == np.float32 and delta.ndim == 1
            and len(base.obj) == len(_npy_header(delta.dtype, delta.shape)) + delta.nbytes):
        return None
    return array("float32", delta.shape, NPY_STYPE, base.obj)  # bytes-like, not bytes


def npy_view(arr: Array) -> np.ndarray:
    """Read-only ndarray view of a Flower Array in .npy format, without copying its bytes."""
    if not isinstance(arr, Array):
        raise WireError(f"expected an Array, got {type(arr).__name__}")
    if arr.stype != NPY_STYPE:
        raise WireError(f"array serialization '{arr.stype}' is not supported, expected "
                        f"'{NPY_STYPE}'")
    data = arr.data
    try:
        shape, fortran, dtype, offset = _read_header(data)
    except (ValueError, SyntaxError, TypeError, tokenize.TokenError) as exc:
        raise WireError(f"malformed .npy array: {exc}") from exc
    if fortran or dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
        raise WireError(f"unsupported .npy array (fortran={fortran}, dtype={dtype})")
    if any(s < 0 for s in shape):
        raise WireError(f"malformed .npy array: negative dimension in shape {shape}")
    count = math.prod(shape)  # exact: a product that overflows int64 must not wrap
    if len(data) - offset != count * dtype.itemsize:
        raise WireError(f"array payload has {len(data) - offset} bytes, header says "
                        f"{count * dtype.itemsize}")
    view = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
    view.flags.writeable = False  # also over a reply buffer shared in-process
    return view
