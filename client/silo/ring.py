"""One cross-silo aggregation: silos meet at the round's rendezvous and allreduce over a ring.

Each silo puts ``[w * delta, w, 1 if w > 0]`` into one float32 buffer and sums it over
the ring (``aggregation.ring.allreduce``), so every silo ends with the same weighted
sum, total weight and count, bit for bit; the aggregate is the weighted mean (or the
sum) and its digest (``client.protocol.ring.aggregate_digest``) is what the server
checks every silo against.
Whatever a silo put into its delta (local DP noise, for one) passes through unchanged:
the ring only adds. Under secure aggregation a silo sums its masked words instead
(:func:`ring_sum_words`: unsigned integers that wrap, reduced mod 2^bits).

The collective runs in a child process whose default process group is this round's
ring, created for the round and gone with the process: a silo's own process group (its
DDP group under ``torchrun``) stays untouched, and a ring that breaks cannot leave
anything behind in the silo. The buffer is shared memory, so the vector is not copied
to the child. Silos first wait for each other at the rendezvous (``join_timeout_s``,
which absorbs differences in training time); once the ring runs, a peer that makes no
progress for ``ring_timeout_s`` ends it with :class:`RingTimeout`, and one that dies
with :class:`RingError`. The parent also bounds the child's whole life, so nothing here
can hang.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from aggregation.ring import RingError, RingTimeout
from client.protocol.ring import RingSpec, aggregate_digest

_EXIT_GRACE_S = 10.0


class RendezvousTimeout(RingTimeout):
    """Some silos did not arrive at the round's rendezvous in time; ``missing`` lists their
    ring ranks."""

    def __init__(self, message: str, *, missing: list[int]) -> None:
        super().__init__(message, step="rendezvous", peer=missing[0] if missing else None)
        self.missing = list(missing)


def blamed_ranks(exc: RingError) -> list[int]:
    """The ring ranks a failure points at: the missing ones, or the peer of the transfer."""
    if isinstance(exc, RendezvousTimeout):
        return exc.missing
    return [] if exc.peer is None else [int(exc.peer)]


@dataclass(frozen=True)
class RingResult:
    """What every silo of a completed ring holds (identical bits everywhere)."""

    aggregate: np.ndarray  # float32 weighted mean (or sum) of the deltas, or the masked sum
    total_weight: float
    count: int  # silos that contributed a non-zero weight
    digest: str
    seconds: float  # rendezvous + allreduce, as seen by this silo


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


# ---- the child process: join, allreduce (or another op on the group), report

# What a ring process runs once the round's group is its default group: it works on the
# tensor in place and returns something picklable for the parent (a module-level
# function, or a functools.partial of one, so that it reaches the child).
RingOp = Callable[[torch.Tensor, RingSpec], Any]


def _sum(work: torch.Tensor, spec: RingSpec) -> None:
    """The default op: sum ``work`` over the group in place."""
    from aggregation.ring import allreduce

    allreduce(work, algorithm=spec.algorithm, timeout=spec.ring_timeout_s, out=work)


def _join(spec: RingSpec) -> Any:
    """The round's store, once every ring rank has arrived (or RingTimeout naming who did not)."""
    import torch.distributed as dist

    try:
        base = dist.TCPStore(spec.host, spec.port, is_master=False,
                             timeout=timedelta(seconds=spec.join_timeout_s))
    except Exception as exc:
        raise RingError(f"cannot reach the rendezvous store at {spec.host}:{spec.port}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
                        step="rendezvous") from exc
    store = dist.PrefixStore(spec.prefix, base)
    store.set(f"joined/{spec.rank}", "1")
    keys = [f"joined/{r}" for r in range(spec.size)]
    try:
        store.wait(keys, timedelta(seconds=spec.join_timeout_s))
    except Exception as exc:
        missing = [r for r in range(spec.size) if not store.check([f"joined/{r}"])]
        if not missing:
            raise
        raise RendezvousTimeout(f"ring rendezvous {spec.prefix}: ring rank(s) {missing} of "
                                f"{spec.size} did not join within {spec.join_timeout_s:g} s; "
                                "they hang or are gone", missing=missing) from exc
    return store


def _ring_child(buf: torch.Tensor, spec: RingSpec, cuda_device: int, conn: Any,
                op: RingOp | None = None) -> None:
    """Body of the ring process: join the round's group, run ``op`` on ``buf`` in place (by
    default sum it over the group), report ``op``'s result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    lo = loopback_interface()
    if is_loopback(spec.host) and lo:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    store, ok = None, False
    try:
        store = _join(spec)
        if spec.backend == "nccl":
            torch.cuda.set_device(cuda_device)
        dist.init_process_group(spec.backend, store=dist.PrefixStore("pg", store),
                                rank=spec.rank, world_size=spec.size,
                                timeout=timedelta(seconds=spec.join_timeout_s))
        run = op or _sum
        if spec.backend == "nccl":
            work = buf.cuda()
            extra = run(work, spec)
            buf.copy_(work.cpu())
        else:
            extra = run(buf, spec)
        conn.send(("ok", extra))
        ok = True
    except RingError as exc:
        conn.send(("ring", isinstance(exc, RingTimeout), str(exc), exc.step, exc.peer,
                   blamed_ranks(exc)))
    except BaseException as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        conn.send(("error", f"{type(exc).__name__}: {text}"))
    # After a success, leave only once every rank is done (or after a while), so no rank
    # closes its sockets while a peer still reads from them. A broken ring just ends.
    if ok and store is not None:
        try:
            store.add("done", 1)
            deadline = time.monotonic() + min(spec.ring_timeout_s, 30.0)
            while store.add("done", 0) < spec.size and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception:
            pass
    os._exit(0)


# ---- the parent: shared buffer, one child per round, a bound on its life

_CTX: Any = None
_CTX_LOCK = threading.Lock()


def _context() -> Any:
    """A forkserver context (torch preloaded: a ring process starts in milliseconds)."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            import torch.multiprocessing as mp

            method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            if method == "forkserver":
                # what every ring process runs: the collectives, gossip's exchange
                ctx.set_forkserver_preload(["torch", "torch.distributed", __name__,
                                            "aggregation.ring.collective",
                                            "client.silo.gossip"])
            _CTX = ctx
        return _CTX


def warm_up() -> None:
    """Start the process that forks ring processes now, not in the first round."""
    from multiprocessing import forkserver

    if _context().get_start_method() == "forkserver":
        forkserver.ensure_running()


def child_limit(spec: RingSpec) -> float:
    """The longest a ring process may live: joining, then every step of the collective."""
    return spec.join_timeout_s + spec.ring_timeout_s * (2 * spec.size + 2) + 30.0


def ring_aggregate(delta: np.ndarray, weight: float, spec: RingSpec, *,
                   cuda_device: int = 0) -> RingResult:
    """Join the round's ring with ``delta`` weighted by ``weight``; the aggregate of all silos.

    Raises :class:`RingTimeout` when a silo does not arrive or stops making progress
    and :class:`RingError` when the ring breaks otherwise. When every silo's weight is
    zero the aggregate is all zeros with ``total_weight`` 0 (nothing to apply). With
    ``spec.backend`` "nccl" the sum runs on GPU ``cuda_device``.
    """
    w = float(weight)
    if not (np.isfinite(w) and w >= 0):
        raise ValueError(f"weight must be finite and >= 0, got {weight}")
    n = int(delta.size)
    buf = torch.empty(n + 2, dtype=torch.float32).share_memory_()
    view = buf.numpy()
    np.multiply(delta.reshape(-1), np.float32(w), out=view[:n], casting="same_kind")
    view[n], view[n + 1] = w, 1.0 if w > 0 else 0.0
    seconds, _ = run_ring(buf, spec, cuda_device)
    total_weight, count = float(view[n]), round(float(view[n + 1]))
    aggregate = view[:n].copy()
    if spec.combine == "mean" and total_weight > 0:
        aggregate /= np.float32(total_weight)
    return RingResult(aggregate=aggregate, total_weight=total_weight, count=count,
                      digest=aggregate_digest(aggregate, total_weight, count), seconds=seconds)


_WORDS = {np.dtype("<u4"): torch.uint32, np.dtype("<u8"): torch.uint64}


def ring_sum_words(words: np.ndarray, bits: int, spec: RingSpec, *,
                   cuda_device: int = 0) -> RingResult:
    """Join the round's ring with a masked vector: the silos' sum of ``words`` mod 2^bits.

    ``words`` are unsigned integers below 2^bits; they travel as uint32 (bits <= 32) or
    uint64 words, which wrap modulo 2^32 or 2^64 in the ring, and the sum is then reduced
    mod 2^bits. One more word counts the silos. The result's ``aggregate`` is the masked
    sum (``total_weight`` 0: the weights are under the masks). Errors as
    :func:`ring_aggregate`.
    """
    wide = np.dtype("<u4") if bits <= 32 else np.dtype("<u8")
    if not 1 <= bits <= 64 or words.dtype.kind != "u" or words.dtype.itemsize > wide.itemsize:
        raise ValueError(f"words must be unsigned integers of at most {bits} bits, got "
                         f"{words.dtype} with bits = {bits}")
    n = int(words.size)
    buf = torch.empty(n + 1, dtype=_WORDS[wide]).share_memory_()
    view = buf.numpy()
    view[:n] = words.reshape(-1)
    view[n] = 1
    seconds, _ = run_ring(buf, spec, cuda_device)
    total = view[:n].copy()
    if bits < 8 * wide.itemsize:
        np.bitwise_and(total, wide.type((1 << bits) - 1), out=total)
    count = int(view[n])
    return RingResult(aggregate=total, total_weight=0.0, count=count,
                      digest=aggregate_digest(total, 0.0, count), seconds=seconds)


def run_ring(buf: torch.Tensor, spec: RingSpec, cuda_device: int = 0,
             op: RingOp | None = None) -> tuple[float, Any]:
    """Sum the shared ``buf`` in place over the round's ring (or run ``op`` on it with the
    round's group), in a child process; the seconds it took and ``op``'s result."""
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    started = time.monotonic()
    proc = ctx.Process(target=_ring_child, args=(buf, spec, cuda_device, writer, op),
                       daemon=True)
    proc.start()
    writer.close()
    limit = child_limit(spec)
    try:
        if not reader.poll(limit):
            raise RingTimeout(f"the ring process of rank {spec.rank} gave no result within "
                              f"{limit:g} s", step="process")
        try:
            outcome = reader.recv()
        except EOFError:
            raise RingError(f"the ring process of rank {spec.rank} died (exit code "
                            f"{proc.exitcode})", step="process") from None
        proc.join(_EXIT_GRACE_S + min(spec.ring_timeout_s, 30.0))
    finally:
        reader.close()
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    seconds = time.monotonic() - started
    if outcome[0] == "ring":
        _, timed_out, text, step, peer, missing = outcome
        if step == "rendezvous" and timed_out:
            raise RendezvousTimeout(text, missing=missing)
        raise (RingTimeout if timed_out else RingError)(text, step=step, peer=peer)
    if outcome[0] == "error":
        raise RingError(f"ring rank {spec.rank}: {outcome[1]}", step="setup")
    return seconds, outcome[1]
