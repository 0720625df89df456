"""Reused buffers for d-word vectors: a client's quantized input and its masked reply.

A fresh multi-megabyte buffer costs a page fault per 4 KiB page on first write (on a
virtual machine about 2 ms for 4 MB, more than masking it with one mask), and a
secure round needs one per client per round: the server keeps every masked reply
until the masked-input stage closes. :class:`BufferPool` hands out writable
memoryviews of pooled bytearrays and takes a buffer back, implicitly, once nothing
refers to it any more (CPython's reference count: every view, array or record over
it is gone), so a buffer that anyone still reads is never handed out again.

Buffers are kept between rounds up to ``max_bytes`` in all; the least recently used
free ones are dropped first. In one process that simulates many clients the pool
therefore keeps about as much memory as one round's masked replies took at their
peak, instead of returning it to the system after every round.
"""

from __future__ import annotations

import sys
import threading

_PAGE = 1 << 16  # capacities are multiples of this: near sizes share buffers
_UNUSED = 2  # references to a free buffer: the pool's list and getrefcount's argument


class _Pooled(bytearray):
    """A buffer owned by a BufferPool."""


class BufferPool:
    """Writable byte buffers reused once nothing refers to them (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[_Pooled] = []  # least recently handed out first
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """``size`` writable bytes (contents undefined) in a buffer nobody else uses."""
        if size < _PAGE:  # small: not worth keeping
            return memoryview(bytearray(size))
        capacity = -(-size // _PAGE) * _PAGE
        with self._lock:
            for i in range(len(self._buffers)):
                if len(self._buffers[i]) == capacity and self._free(i):
                    buf = self._buffers.pop(i)
                    self._buffers.append(buf)
                    return memoryview(buf)[:size]
            buf = _Pooled(capacity)
            if self._make_room(capacity):
                self._buffers.append(buf)  # else handed out unpooled
            return memoryview(buf)[:size]

    @property
    def pooled_bytes(self) -> int:
        return sum(len(b) for b in self._buffers)

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) == _UNUSED

    def _make_room(self, capacity: int) -> bool:
        """Drop free buffers, least recently used first, until ``capacity`` more fits;
        whether it fits."""
        total = self.pooled_bytes
        i = 0
        while total + capacity > self.max_bytes and i < len(self._buffers):
            if self._free(i):
                total -= len(self._buffers.pop(i))
            else:
                i += 1
        return total + capacity <= self.max_bytes


#: The pool of this process's secure-aggregation clients.
POOL = BufferPool(max_bytes=1 << 30)
