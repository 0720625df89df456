"""Ring allreduce: reduce-scatter then all-gather over point-to-point transfers.

Rank ``r`` of ``n`` splits the vector into ``n`` chunks. At step ``t`` (``0 <= t <
2(n-1)``) it sends chunk ``(r - t) mod n`` to its right neighbour and receives chunk
``(r - t - 1) mod n`` from its left one; in the first ``n - 1`` steps
(reduce-scatter) it adds the received values, in the last ``n - 1`` (all-gather)
it keeps them. Each rank sends ``2(n-1)/n`` of the vector, whatever ``n`` is.

:func:`ring_pipelined` cuts every chunk into segments and forwards a segment as
soon as it has been reduced, so the add of one segment overlaps the transfer of
the next and consecutive steps overlap too. :func:`ring_stepwise` finishes each
step before the next (segments overlap only within a step); it is what NCCL
uses, where each step is one grouped send/receive pair.
"""

from __future__ import annotations

from collections import deque

import torch

from aggregation.ring.channel import Channel, Pending
from aggregation.ring.chunks import chunk_spans, segment_spans
from aggregation.ring.exchange import Scratch, exchange


def _step_name(t: int, n: int) -> str:
    if t < n - 1:
        return f"reduce-scatter step {t + 1}/{n - 1}"
    return f"all-gather step {t - n + 2}/{n - 1}"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat tensors share any memory."""
    a_end = a.data_ptr() + a.numel() * a.element_size()
    b_end = b.data_ptr() + b.numel() * b.element_size()
    return a.data_ptr() < b_end and b.data_ptr() < a_end


def ring_stepwise(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
                  segment: int | None, window: int) -> None:
    """Ring allreduce of flat ``src`` into flat ``out``, one step at a time."""
    n, r = ch.size, ch.rank
    spans = chunk_spans(src.numel(), n)
    right, left = (r + 1) % n, (r - 1) % n
    scratch = Scratch(src)
    for t in range(2 * (n - 1)):
        slo, shi = spans[(r - t) % n]
        rlo, rhi = spans[(r - t - 1) % n]
        reduce = t < n - 1
        exchange(ch, _step_name(t, n),
                 send=(src if t == 0 else out)[slo:shi], send_peer=right,
                 dst=out[rlo:rhi], recv_peer=left, base=src[rlo:rhi] if reduce else None,
                 segment=segment, window=window, scratch=scratch)
        if mean and t == n - 2:
            out[rlo:rhi].div_(n)


def ring_pipelined(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
                   segment: int, window: int) -> None:
    """Ring allreduce of flat ``src`` into flat ``out`` with segments pipelined across steps.

    Receives are posted ahead: up to ``window`` reduce-scatter segments (each needs
    a scratch buffer, a "slot") and every all-gather segment (they land in ``out``)
    as soon as the receives before them are posted; the first ones before the first
    sends, as gloo's own ring does, so a peer's data can flow at once. A reduced
    segment is sent on at once. Before the last reduce-scatter step a segment is
    reduced in its slot (``buf += src``, in cache and without touching ``out``) and
    sent from there; the last step writes ``out = src + buf``.

    Waiting for a send can close a cycle around the ring, so a send is waited for
    only once this rank has consumed the item its right neighbour receives it as
    (the neighbour posts that receive before consuming it, so the wait depends on a
    rank that is no further along). gloo's works report completion only once waited
    on, so these waits are what frees things: a slot whose send is old enough is
    reused when no other is free (scratch stays about one chunk plus ``window``
    segments), and the step-0 sends, which read ``src``, are waited for as their
    receives are consumed, so that in-place all-gather receives can land in ``out``.
    """
    n, r = ch.size, ch.rank
    steps = 2 * (n - 1)
    segs = [segment_spans(span, segment) for span in chunk_spans(src.numel(), n)]
    right, left = (r + 1) % n, (r - 1) % n
    # Receive stream: step t brings chunk (r - t - 1) mod n, segment by segment.
    items = [(t, j) for t in range(steps) for j in range(len(segs[(r - t - 1) % n]))]
    scratch = Scratch(src)
    in_place = _overlap(src, out)
    sends: dict[tuple[int, int], Pending] = {}  # sends that read src or out
    slot_sends: dict[int, tuple[tuple[int, int], Pending]] = {}  # slot -> (item, send)
    free_slots: list[int] = []
    slots_made = 0
    consumed = (-1, -1)  # the last item consumed

    def take_slot() -> int:
        """A free slot; else the slot of the oldest send safe to wait for; else a new one."""
        nonlocal slots_made
        if free_slots:
            return free_slots.pop()
        old = [(item, slot) for slot, (item, _) in slot_sends.items() if item <= consumed]
        if old:
            slot = min(old)[1]
            ch.wait(slot_sends.pop(slot)[1])
            return slot
        slots_made += 1
        return slots_made - 1

    inflight: deque[tuple[Pending, torch.Tensor, int]] = deque()

    def label(t: int, j: int, chunk: int) -> str:
        return f"{_step_name(t, n)}, segment {j + 1}/{len(segs[chunk])}"

    def post_send(t: int, j: int, data: torch.Tensor | None = None, slot: int = -1) -> None:
        chunk = (r - t) % n
        lo, hi = segs[chunk][j]
        if data is not None:
            slot_sends[slot] = ((t, j), ch.post(label(t, j, chunk), sends=[(data, right)]))
            return
        data = (src if t == 0 else out)[lo:hi]
        sends[(t, j)] = ch.post(label(t, j, chunk), sends=[(data, right)])

    def post_recv(k: int, block: bool) -> bool:
        """Post receive ``k``; False if it must wait for a send that is still in flight."""
        t, j = items[k]
        chunk = (r - t - 1) % n
        lo, hi = segs[chunk][j]
        slot = -1
        if t < n - 1:
            slot = take_slot()
            buf = scratch.get(slot, hi - lo)
        else:
            # Of the reduce-scatter sends of this region only step 0's read src, which
            # matters only when src is out.
            earlier = sends.get((t - n + 1, j)) if in_place else None
            if earlier is not None:
                if not block and not ch.done(earlier):
                    return False
                ch.wait(sends.pop((t - n + 1, j)))
            buf = out[lo:hi]
        inflight.append((ch.post(label(t, j, chunk), recvs=[(buf, left)]), buf, slot))
        return True

    # Receives from one peer match in posting order, so they are posted strictly in
    # order. One that would have to block is left for its turn (blocking earlier,
    # with later receives not yet posted, could deadlock the ring).
    posted = 0

    def prefetch(limit: int) -> None:
        nonlocal posted
        while (posted < len(items) and (posted < limit or items[posted][0] >= n - 1)
               and post_recv(posted, block=False)):
            posted += 1

    prefetch(min(window, len(segs[(r - 1) % n])))
    for j in range(len(segs[r])):
        post_send(0, j)
    prefetch(window)
    for k, (t, j) in enumerate(items):
        if posted == k:
            post_recv(k, block=True)
            posted += 1
        pending, buf, slot = inflight.popleft()
        ch.wait(pending)
        consumed = (t, j)
        lo, hi = segs[(r - t - 1) % n][j]
        if t < n - 2:
            post_send(t + 1, j, buf.add_(src[lo:hi]), slot)
        else:
            if t == n - 2:
                torch.add(src[lo:hi], buf, out=out[lo:hi])
                if mean:
                    out[lo:hi].div_(n)
                free_slots.append(slot)
            if t + 1 < steps:
                post_send(t + 1, j)
        if in_place and t == 0:
            for key in [key for key in sends if key[0] == 0 and key[1] <= j]:
                ch.wait(sends.pop(key))  # safe: this rank has consumed item (0, j)
        prefetch(k + 1 + window)
    for pending in [*sends.values(), *(p for _, p in slot_sends.values())]:
        ch.wait(pending)
