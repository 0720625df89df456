"""Checkpoint payloads sealed with their sha256, and the thread that writes them in the
background.

A payload (format 2) is ``MAGIC``, the parameter count and the state's length (two
little-endian uint64), the flat float32 parameters as raw little-endian bytes, then the
state as a ``serialize.pack_state`` archive with an empty parameter vector. The
parameters are copied once into the payload, with no zip CRC over them: the sha256
recorded beside the payload is what checks them. Payloads of format 1 (a
``pack_state`` archive holding the parameters too, as written before) still read.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from typing import Any

import numpy as np

from .errors import CorruptCheckpoint
from .serialize import pack_state, unpack_state
from .values import check_int


def check_checkpoint_args(rnd: Any, version: Any, keep: Any,
                          params: Any) -> tuple[int, int, int]:
    """Checked (round, model_version, keep) of a checkpoint; params must be flat float32."""
    checked = (check_int(rnd, "round", minimum=0),
               check_int(version, "model_version", minimum=0),
               check_int(keep, "keep", minimum=1))
    if not isinstance(params, np.ndarray) or params.ndim != 1 or params.dtype != np.float32:
        desc = (
            f"{params.dtype} array of shape {params.shape}"
            if isinstance(params, np.ndarray)
            else type(params).__name__
        )
        raise ValueError(f"params must be a flat float32 numpy array, got a {desc}")
    return checked


MAGIC = b"FRCKPT\x00\x02"  # format 2 (format 1 payloads are zip archives: b"PK...")
_HEADER = struct.Struct("<QQ")  # parameter count, state archive length
_START = len(MAGIC) + _HEADER.size
_F32 = np.dtype("<f4")
_NO_PARAMS = np.zeros(0, dtype=_F32)


def seal(params: np.ndarray, state: dict) -> tuple[bytes, str]:
    """The payload of ``params`` (flat float32) and ``state``, and its sha256 hex."""
    flat = np.ascontiguousarray(params, dtype=_F32).reshape(-1)
    packed = pack_state(_NO_PARAMS, state)
    payload = b"".join((MAGIC, _HEADER.pack(flat.size, len(packed)),
                        memoryview(flat).cast("B"), packed))
    return payload, hashlib.sha256(payload).hexdigest()


def open_payload(payload: bytes) -> tuple[np.ndarray, dict]:
    """``(params, state)`` of a payload of either format; ValueError if it is not one."""
    if not payload.startswith(MAGIC[:6]):
        return unpack_state(payload)  # format 1
    if not payload.startswith(MAGIC):
        raise ValueError(f"checkpoint payload format {payload[6:8].hex()} is not one this "
                         "code reads (format 2, or a format 1 archive)")
    if len(payload) < _START:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes is shorter than its "
                         "header")
    count, packed = _HEADER.unpack_from(payload, len(MAGIC))
    end = _START + count * _F32.itemsize
    if end + packed != len(payload):
        raise ValueError(f"checkpoint payload of {len(payload)} bytes does not hold the "
                         f"{count} parameters and {packed} bytes of state its header states")
    _, state = unpack_state(payload[end:])
    params = np.frombuffer(payload, dtype=_F32, count=count, offset=_START)
    return params.astype(np.float32), state  # a writable copy, in the machine's order


def unseal(payload: bytes, recorded_sha256: str, where: str) -> tuple[np.ndarray, dict]:
    """``(params, state)`` of a payload; CorruptCheckpoint if it fails its recorded sha256
    or cannot be decoded (``where`` names the checkpoint in the message)."""
    digest = hashlib.sha256(payload).hexdigest()
    if digest != recorded_sha256:
        raise CorruptCheckpoint(
            f"{where} is corrupted: its payload ({len(payload)} bytes) has sha256 "
            f"{digest}, but {recorded_sha256} was recorded when it was saved"
        )
    try:
        return open_payload(payload)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{where} cannot be decoded: {exc}") from exc


class BackgroundWriter:
    """One writer thread, at most one write in flight.

    ``submit`` waits for the previous write, then copies ``params`` (into a buffer reused
    from write to write) and ``state``, so the caller may change them at once.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self.in_flight: Future[Any] | None = None
        self._snapshot: np.ndarray | None = None

    def submit(self, write: Callable[[np.ndarray, dict], Any], params: np.ndarray,
               state: dict) -> None:
        self.wait()
        snapshot = self._snapshot
        if snapshot is None or snapshot.shape != params.shape:
            snapshot = self._snapshot = np.empty_like(params)
        np.copyto(snapshot, params)  # reused: the previous write has finished with it
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fedring-checkpoint")
        self.in_flight = self._executor.submit(write, snapshot, deepcopy(state))

    def wait(self) -> None:
        """Wait for the write in flight, if any; a failed write raises its error here, once."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            pending.result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
