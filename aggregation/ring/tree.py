"""Recursive-doubling allreduce, with the standard fold-in for any world size.

With ``p`` the largest power of two ``<= n``, ranks ``p..n-1`` first hand their
vector to rank ``r - p`` and wait for the result. The ``p`` remaining ranks run
``log2 p`` rounds; in round ``k`` rank ``r`` swaps its partial sum with rank
``r XOR 2^k`` and adds. Both partners add the same two vectors (in swapped
order, which is exact), so every rank ends with bit-identical results.
"""

from __future__ import annotations

import torch

from aggregation.ring.channel import Channel
from aggregation.ring.exchange import Scratch, exchange, fold_in, fold_out


def recursive_doubling(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
                       segment: int | None, window: int) -> None:
    """Allreduce flat ``src`` into flat ``out`` by recursive doubling."""
    n, r = ch.size, ch.rank
    opts = {"segment": segment, "window": window, "scratch": Scratch(src)}
    p, cur = fold_in(ch, src, out, opts)
    if cur is None:
        return
    rounds = p.bit_length() - 1
    for k in range(rounds):
        partner = r ^ (1 << k)
        exchange(ch, f"doubling round {k + 1}/{rounds}", send=cur, send_peer=partner,
                 dst=out, recv_peer=partner, base=cur, **opts)
        cur = out
    if cur is src:
        out.copy_(src)
    if mean:
        out.div_(n)
    fold_out(ch, out, p, opts)
