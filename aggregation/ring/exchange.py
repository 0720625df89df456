"""One step of a collective: send a region to a peer while receiving (and reducing) another."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from aggregation.ring.channel import Channel, Pending
from aggregation.ring.chunks import segment_spans

_CACHE_LIMIT_BYTES = 64 << 20
_pool = threading.local()


def _segment_cap_bytes() -> int:
    """The largest segment a rank sends over gloo's TCP transport: the largest send
    buffer the kernel auto-tunes a TCP socket to (``net.ipv4.tcp_wmem``), 4 MiB where
    that is unknown.

    A gloo send is written by the thread that posts it only while it fits the socket's
    send buffer; the rest is left to gloo's one event-loop thread, which also reads
    everything that arrives. Segments of that size, several in flight, measured best
    here: halving_doubling over native gloo at n = 2, 16 / 64 MiB, was 0.65-0.67 with
    3 MiB in flight at a time, 0.94-0.96 in 1 MiB segments 16 or 32 deep, and 0.98-1.05
    in 4 MiB segments 8 or 16 deep (one paired run of 21 iterations).
    """
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            largest = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        largest = 4 << 20
    return max(64 << 10, largest)


SEGMENT_CAP_BYTES = _segment_cap_bytes()


class Scratch:
    """Receive buffers ("slots") for one collective, reused across calls.

    Fresh large allocations are costly (every page faults on first touch), so
    buffers up to 64 MiB are kept per thread, dtype, device and slot. Callers
    reuse a slot only after the receive into it has been consumed.
    """

    def __init__(self, like: torch.Tensor) -> None:
        self._dtype = like.dtype
        self._device = like.device
        self._local: dict[int, torch.Tensor] = {}

    def get(self, slot: int, numel: int) -> torch.Tensor:
        """A ``numel``-element buffer for ``slot``."""
        buf = self._local.get(slot)
        if buf is None or buf.numel() < numel:
            cache: dict = _pool.__dict__.setdefault("buffers", {})
            key = (self._dtype, self._device, slot)
            buf = cache.get(key)
            if buf is None or buf.numel() < numel:
                buf = torch.empty(numel, dtype=self._dtype, device=self._device)
                if buf.numel() * buf.element_size() <= _CACHE_LIMIT_BYTES:
                    cache[key] = buf
            self._local[slot] = buf
        return buf[:numel]


def exchange(
    ch: Channel,
    step: str,
    *,
    send: torch.Tensor | None = None,
    send_peer: int | None = None,
    dst: torch.Tensor | None = None,
    recv_peer: int | None = None,
    base: torch.Tensor | None = None,
    segment: int | None,
    window: int,
    scratch: Scratch,
) -> None:
    """Send ``send`` to ``send_peer`` and receive ``dst`` from ``recv_peer``, segment by segment.

    On gloo a segment is at most ``SEGMENT_CAP_BYTES``; a longer one is cut into that
    many more pieces, as many more of them in flight, so the bytes in flight stay
    ``segment * window``.

    With ``base`` the received values are added to it: ``dst = base + received``
    (``base`` may be ``dst`` or ``send``; a segment is only overwritten after its
    send completed). Without ``base`` the data lands directly in ``dst``. Up to
    ``window`` segments are in flight, so the add of one overlaps the transfer of
    the next. Returns when every send and receive has completed.
    """
    if segment is not None and not ch.coalesce:  # gloo: see SEGMENT_CAP_BYTES
        cap = max(1, SEGMENT_CAP_BYTES // (send if send is not None else dst).element_size())
        if segment > cap:
            window *= -(-segment // cap)  # the same bytes in flight, in smaller pieces
            segment = cap
    send_spans = segment_spans((0, send.numel()), segment) if send is not None else []
    recv_spans = segment_spans((0, dst.numel()), segment) if dst is not None else []
    count = max(len(send_spans), len(recv_spans))
    posted: deque[tuple[Pending, torch.Tensor | None]] = deque()

    def post(j: int) -> None:
        sends = []
        recvs = []
        buf = None
        if j < len(send_spans):
            lo, hi = send_spans[j]
            sends.append((send[lo:hi], send_peer))
        if j < len(recv_spans):
            lo, hi = recv_spans[j]
            buf = dst[lo:hi] if base is None else scratch.get(j % window, hi - lo)
            recvs.append((buf, recv_peer))
        label = step if count == 1 else f"{step}, segment {j + 1}/{count}"
        posted.append((ch.post(label, sends, recvs), buf))

    for j in range(min(window, count)):
        post(j)
    for j in range(count):
        pending, buf = posted.popleft()
        ch.wait(pending)
        if base is not None and buf is not None:
            lo, hi = recv_spans[j]
            torch.add(base[lo:hi], buf, out=dst[lo:hi])
        if j + window < count:
            post(j + window)


def fold_in(ch: Channel, src: torch.Tensor, out: torch.Tensor,
            opts: dict[str, Any]) -> tuple[int, torch.Tensor | None]:
    """The standard fold of a power-of-two algorithm onto any world size: with ``p`` the
    largest power of two ``<= n``, ranks ``p..n-1`` hand their vector to rank ``r - p``
    (which adds it into ``out``) and wait there for the result. Returns ``p`` and the
    vector this rank goes on with (``src``, or ``out`` after a fold), or None on a folded
    rank, which is then done; ``fold_out`` sends the result back."""
    n, r = ch.size, ch.rank
    p = 1 << (n.bit_length() - 1)
    if r >= p:
        exchange(ch, "fold-in", send=src, send_peer=r - p, **opts)
        exchange(ch, "fold-out", dst=out, recv_peer=r - p, **opts)
        return p, None
    if r < n - p:
        exchange(ch, "fold-in", dst=out, recv_peer=r + p, base=src, **opts)
        return p, out
    return p, src


def fold_out(ch: Channel, out: torch.Tensor, p: int, opts: dict[str, Any]) -> None:
    """Send the result to the rank folded onto this one (see ``fold_in``), if any."""
    if ch.rank < ch.size - p:
        exchange(ch, "fold-out", send=out, send_peer=ch.rank + p, **opts)
