"""All-to-all allreduce: every chunk goes to the rank that owns it, which sums it and
sends it back to everyone.

Rank ``r`` of ``n`` owns chunk ``r``. Reduce: in step ``t = 1..n-1`` rank ``r``
sends chunk ``(r + t) mod n`` to its owner and adds the copy of chunk ``r`` that
rank ``(r - t) mod n`` sends it. Gather: in step ``t`` rank ``r`` sends its summed
chunk to rank ``(r + t) mod n`` and receives chunk ``(r - t) mod n`` from its owner.
Each rank sends ``2(n-1)/n`` of the vector, like the ring, but in ``2(n-1)``
messages to ``n - 1`` different peers; each chunk is summed on one rank only, so
all ranks end with bit-identical results.
"""

from __future__ import annotations

import torch

from aggregation.ring.channel import Channel
from aggregation.ring.chunks import chunk_spans
from aggregation.ring.exchange import Scratch, exchange


def all_to_all(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
               segment: int | None, window: int) -> None:
    """Allreduce flat ``src`` into flat ``out`` through the owner of each chunk."""
    n, r = ch.size, ch.rank
    spans = [slice(lo, hi) for lo, hi in chunk_spans(src.numel(), n)]
    opts = {"segment": segment, "window": window, "scratch": Scratch(src)}
    own = spans[r]
    cur = src
    for t in range(1, n):
        to, frm = (r + t) % n, (r - t) % n
        exchange(ch, f"reduce step {t}/{n - 1}", send=src[spans[to]], send_peer=to,
                 dst=out[own], recv_peer=frm, base=cur[own], **opts)
        cur = out
    if mean:
        out[own].div_(n)
    for t in range(1, n):
        to, frm = (r + t) % n, (r - t) % n
        exchange(ch, f"gather step {t}/{n - 1}", send=out[own], send_peer=to,
                 dst=out[spans[frm]], recv_peer=frm, **opts)
