"""Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling all-gather.

With ``p`` the largest power of two ``<= n``, ranks ``p..n-1`` first hand their
vector to rank ``r - p`` (which adds it) and get the result back at the end. The
``p`` remaining ranks split the vector into ``p`` chunks. Reduce-scatter: for
``mask = p/2, p/4, ..., 1`` rank ``r`` and ``r XOR mask`` split the chunks they
still hold in halves; the rank with that bit clear keeps the lower half, the other
the upper, each sends the half it gives away and adds the half it receives. After
``log2 p`` rounds rank ``r`` holds chunk ``r`` fully reduced. All-gather runs the
rounds backwards (``mask = 1, 2, ..., p/2``), each rank sending all it holds.

Each rank sends ``2(p-1)/p`` of the vector in ``2 log2 p`` messages: bandwidth of
the ring, latency of the tree. Every chunk is reduced on one rank only, so all
ranks end with bit-identical results.
"""

from __future__ import annotations

import torch

from aggregation.ring.channel import Channel
from aggregation.ring.chunks import chunk_spans
from aggregation.ring.exchange import Scratch, exchange, fold_in, fold_out


def halving_doubling(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
                     segment: int | None, window: int) -> None:
    """Allreduce flat ``src`` into flat ``out`` by recursive halving then doubling."""
    n, r = ch.size, ch.rank
    opts = {"segment": segment, "window": window, "scratch": Scratch(src)}
    p, cur = fold_in(ch, src, out, opts)
    if cur is None:
        return
    spans = chunk_spans(src.numel(), p)
    rounds = p.bit_length() - 1

    def region(first: int, last: int) -> slice:
        """Elements of chunks ``first..last-1``."""
        return slice(spans[first][0], spans[last - 1][1])

    lo, hi = 0, p  # the chunks this rank still holds
    for k in range(rounds):
        mask = p >> (k + 1)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if r & mask == 0 else ((mid, hi), (lo, mid))
        kept = region(*keep)
        exchange(ch, f"halving round {k + 1}/{rounds}", send=cur[region(*give)],
                 send_peer=r ^ mask, dst=out[kept], recv_peer=r ^ mask, base=cur[kept], **opts)
        cur = out
        lo, hi = keep
    if mean:
        out[region(lo, hi)].div_(n)
    for k in range(rounds):
        mask = 1 << k
        width = hi - lo
        other = (lo + width, hi + width) if r & mask == 0 else (lo - width, hi - width)
        exchange(ch, f"doubling round {k + 1}/{rounds}", send=out[region(lo, hi)],
                 send_peer=r ^ mask, dst=out[region(*other)], recv_peer=r ^ mask, **opts)
        lo, hi = min(lo, other[0]), max(hi, other[1])
    fold_out(ch, out, p, opts)
