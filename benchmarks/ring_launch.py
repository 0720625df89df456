"""Run a function on a local torch.distributed process group (one process per rank).

A test and benchmark tool, not shipped: ``benchmarks/allreduce.py`` imports it as
``ring_launch``, and so do the tests (``tests/ring/conftest.py``). ``launch(fn, n, *args)``
starts ``n`` fresh processes (``forkserver`` or ``spawn``, never a plain fork of the
caller), joins them into a gloo group over 127.0.0.1 (the rendezvous store listens on a
free port chosen by the OS) and calls ``fn(rank, world_size, *args)`` in each. It returns
the per-rank return values, or raises the first rank's exception (with the remote
traceback as a note).

``fn`` must be importable by name (a module-level function) and its arguments
and return value picklable; return small summaries, not large tensors.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["LaunchError", "launch"]


_RELEASE_WAIT_S = 600.0
_EXIT_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """A rank died without a result, or the group did not finish in time."""


def _loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _context(start_method: str | None) -> Any:
    """A multiprocessing context; the forkserver preloads torch for fast starts."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def _remote_error(rank: int, world_size: int, exc_bytes: bytes, tb: str) -> BaseException:
    """The exception a rank raised, with its traceback attached as a note."""
    try:
        exc = pickle.loads(exc_bytes)
    except Exception:
        exc = LaunchError(f"rank {rank} raised an exception that could not be unpickled")
    exc.add_note(f"raised on rank {rank} of {world_size}:\n{tb}")
    return exc


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    num_threads: int | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    """Body of one rank: join the group, run ``fn``, send back the outcome."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    iface = _loopback_interface()
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    ok = False
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        payload = pickle.dumps(("ok", result))
        ok = True
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:
            exc_bytes = pickle.dumps(RuntimeError(repr(exc)))
        payload = pickle.dumps(("err", exc_bytes, traceback.format_exc()))
    conn.send_bytes(payload)
    # Wait until every rank has reported (the parent then writes one byte), so no
    # rank closes its sockets while a peer may still be reading from them.
    try:
        if conn.poll(_RELEASE_WAIT_S):
            conn.recv_bytes()
    except (EOFError, OSError):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after a failed collective, pending gloo work can
    # block or abort in destructors, and the outcome has already been reported.
    os._exit(0 if ok else 1)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    num_threads: int | None = 1,
    allow_exit: Collection[int] = (),
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    ``timeout`` bounds the whole run (seconds); ``pg_timeout`` is the process
    group's own timeout. ``num_threads`` sets torch's intra-op threads per rank
    (``None`` keeps torch's default). Ranks in ``allow_exit`` may exit without
    returning (e.g. a test that kills a rank); their result is ``None``.
    ``start_method`` defaults to ``forkserver`` where available (torch is imported
    once in the server, so each rank starts in milliseconds), else ``spawn``.
    Raises the first exception raised by any rank, or :class:`LaunchError`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout))
    ctx = _context(start_method)
    pipes = [ctx.Pipe(duplex=True) for _ in range(world_size)]
    readers = [r for r, _ in pipes]
    writers = [w for _, w in pipes]
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=_child,
            args=(rank, world_size, store.port, backend, pg_timeout, num_threads, fn, args,
                  writers[rank]),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    for w in writers:
        w.close()

    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(f"ranks {sorted(pending)} did not finish within {timeout} s")
            ready = wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending],
                         timeout=remaining)
            for rank in sorted(pending):
                if readers[rank] in ready:
                    try:
                        message = pickle.loads(readers[rank].recv_bytes())
                    except EOFError:
                        message = None
                    if message is None:
                        procs[rank].join(timeout=5)
                        if rank in allow_exit:
                            pending.discard(rank)
                            continue
                        raise LaunchError(
                            f"rank {rank} exited (code {procs[rank].exitcode}) without a result")
                    if message[0] == "err":
                        raise _remote_error(rank, world_size, message[1], message[2])
                    results[rank] = message[1]
                    pending.discard(rank)
                elif procs[rank].sentinel in ready and not readers[rank].poll():
                    if rank in allow_exit:
                        pending.discard(rank)
                        continue
                    raise LaunchError(
                        f"rank {rank} exited (code {procs[rank].exitcode}) without a result")
        for rank, reader in enumerate(readers):
            if procs[rank].is_alive():
                with contextlib.suppress(OSError):
                    reader.send_bytes(b"1")
        for proc in procs:
            proc.join(timeout=_EXIT_GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        for r in readers:
            r.close()
    return results
