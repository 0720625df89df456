"""Reply encoding: cached .npy headers, and delta buffers shared (not copied) in-process."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array

from client.protocol.errors import WireError
from client.protocol.npy import NPY_STYPE, ReplyBuffers, npy_array, npy_view
from client.protocol.updates import delta_record


@pytest.mark.parametrize("a", [np.arange(12, dtype=np.float32).reshape(3, 4),
                               np.float64(2.5) * np.ones(7),
                               np.zeros((2, 0, 3), np.float16),
                               np.asfortranarray(np.ones((3, 2), np.float32))])
def test_encoding_is_numpys_npy_format_and_reads_back(a):
    expected = io.BytesIO()
    np.save(expected, np.ascontiguousarray(a), allow_pickle=False)
    for _ in range(2):  # the second time the header comes from the cache
        arr = npy_array(a)
        assert arr.data == expected.getvalue()
        view = npy_view(arr)
        np.testing.assert_array_equal(view, a)
        assert view.dtype == a.dtype and not view.flags.writeable
        assert np.array_equal(arr.numpy(), a)  # Flower reads it too


def _raw(data: bytes) -> Array:
    return Array(dtype="float32", shape=(2,), stype=NPY_STYPE, data=data)


@pytest.mark.parametrize("data, message", [
    (b"", "malformed"), (b"\x93NUMP", "malformed"), (b"not numpy at all", "malformed"),
    (b"\x93NUMPY\x01\x00\xff\x7f{'descr'", "malformed"),  # header longer than the data
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': 5}    \n" + bytes(8), "malformed"),
])
def test_malformed_headers_are_refused(data, message):
    with pytest.raises(WireError, match=message):
        npy_view(_raw(data))


def test_a_cached_header_still_checks_the_payload_length():
    good = npy_array(np.ones(4, np.float32)).data
    npy_view(_raw(good))
    with pytest.raises(WireError, match="payload has 12 bytes"):
        npy_view(_raw(good[:-4]))


def test_a_shared_delta_reply_is_the_buffer_itself():
    buffers = ReplyBuffers()
    delta = buffers.delta(1000)
    delta[:] = np.arange(1000, dtype=np.float32)
    arr = delta_record(delta)["delta"]
    assert isinstance(arr.data, bytearray) and len(arr.data) == 128 + 4000
    seen = npy_view(arr)
    assert np.shares_memory(seen, delta)  # no copy on the way
    np.testing.assert_array_equal(seen, np.arange(1000, dtype=np.float32))
    assert not seen.flags.writeable  # the server cannot change the client's buffer
    assert np.array_equal(arr.numpy(), delta)  # and it is still a valid .npy array


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    buffers = ReplyBuffers()
    first = buffers.delta(64)
    first[:] = 1.0
    kept = npy_view(delta_record(first)["delta"])  # e.g. a robust combine keeps it
    del first
    second = buffers.delta(64)
    second[:] = 2.0
    assert not np.shares_memory(kept, second)
    np.testing.assert_array_equal(kept, np.ones(64, np.float32))  # untouched
    address = second.ctypes.data
    del second
    third = buffers.delta(64)  # nothing refers to the second buffer any more: reused
    assert third.ctypes.data == address
    assert buffers.delta(32).size == 32  # another size gets its own buffer


def test_a_delta_may_be_written_again_only_when_nothing_else_refers_to_its_buffer():
    buffers = ReplyBuffers(keep=1)
    delta = buffers.delta(64)
    assert buffers.unused_but_for(delta)
    record = delta_record(delta)  # the reply carries the buffer
    assert not buffers.unused_but_for(delta)
    seen = npy_view(record["delta"])  # the server's view of it
    del record
    assert not buffers.unused_but_for(delta)
    del seen
    assert buffers.unused_but_for(delta)
    assert not buffers.unused_but_for(np.zeros(64, np.float32))  # not from these buffers
    buffers.delta(32)  # keep=1: the first buffer leaves the pool
    assert not buffers.unused_but_for(delta)
    delta = buffers.delta(16)
    record = delta_record(delta)  # a reply carries it, and the buffer leaves the pool:
    buffers.delta(8)              # its reference count alone would look like a free one's
    assert not buffers.unused_but_for(delta)
    assert record["delta"].data is delta.base.obj


def test_other_deltas_are_copied_into_bytes():
    delta = np.arange(10, dtype=np.float32)
    arr = delta_record(delta)["delta"]
    assert type(arr.data) is bytes
    delta[:] = 0.0
    np.testing.assert_array_equal(npy_view(arr), np.arange(10, dtype=np.float32))
    strided = ReplyBuffers().delta(20)[::2]  # a slice of a buffer is not a whole reply
    assert type(delta_record(strided)["delta"].data) is bytes
