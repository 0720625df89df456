"""A local wake-up from a SuperNode to its warm executor: "a ClientApp task is ready".

Without it the executor asks the SuperNode's Runtime API for a task every few
milliseconds, one HTTP request (over TLS when the API has it) per poll, on the cores the
SuperNode and the other nodes also need. With it the SuperNode sends one datagram on a
Unix socket once a message and all its objects are stored, and the executor waits on
that socket, asking for a task when woken (and every ``idle_s`` in case a datagram was
lost). A ``name`` with a ``/`` is a socket path, any other name a Linux abstract socket
(no file to clean up).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Callable


def address(name: str) -> str:
    """The socket address of ``name``: a path as it is, else an abstract name."""
    if not name:
        raise ValueError("a task signal needs a non-empty name")
    return name if "/" in name else "\0" + name


def notifier(name: str) -> Callable[[], None]:
    """A function that wakes the executor listening on ``name``; it never blocks or raises
    (with no listener the datagram is dropped: the executor's idle poll still finds the
    task)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    target = address(name)

    def notify() -> None:
        with contextlib.suppress(OSError):
            sock.sendto(b"\1", target)

    return notify


class TaskSignal:
    """The executor's end: bound to ``name``; ``wait`` returns once woken or after a timeout."""

    def __init__(self, name: str) -> None:
        target = address(name)
        if not target.startswith("\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(target)
        self._sock.setblocking(False)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up; True if one came (all pending ones are
        consumed: one claim pass serves them)."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        woken = False
        while ready:
            try:
                self._sock.recv(16)
                woken = True
            except BlockingIOError:
                break
        return woken

    def close(self) -> None:
        self._sock.close()
