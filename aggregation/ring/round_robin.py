"""Round-robin allreduce: every rank reduces one chunk, meeting every other rank in turn,
one partner per step, as the rounds of a round-robin tournament.

This follows the round-robin allreduce of the distributed deep learning lectures, listed
beside the butterfly and the ring: the vector is cut into ``n`` chunks, rank ``r``
sums chunk ``r`` from the copies every other rank sends it, then sends the sum back to
every rank. The pairs meet in the rounds of a round-robin tournament (the circle
method): in every step each rank has exactly one partner and the two swap what each
owes the other, both directions of one link at once. With ``m = n - 1`` (``n`` even:
rank ``n - 1`` meets rank ``t`` in round ``t``) or ``m = n`` (``n`` odd: the rank that
would meet itself sits the round out), rank ``i < m`` meets ``(2t - i) mod m`` in round
``t = 0..m-1``; over the ``m`` rounds every pair meets once.

Reduce: in round ``t`` rank ``r`` sends chunk ``p`` to its partner ``p`` and adds
the copy of chunk ``r`` that ``p`` sends it. Gather: the same rounds again, each rank
sending its summed chunk and receiving its partner's. Cost for a vector of ``S``
bytes: ``2(n - 1)`` messages per rank, each of ``S / n`` bytes, so ``2(n-1)/n * S``
bytes per rank (the ring's), in ``2(n - 1)`` steps for even ``n`` and ``2n`` for odd
``n`` (a rank rests in one step of each phase). Unlike ``all_to_all``, whose step ``t``
sends to ``r + t`` while receiving from ``r - t``, each step pairs ranks off. Each
chunk is summed on one rank only, so all ranks end with bit-identical results.
"""

from __future__ import annotations

import torch

from aggregation.ring.channel import Channel
from aggregation.ring.chunks import chunk_spans
from aggregation.ring.exchange import Scratch, exchange


def partner(rank: int, n: int, t: int) -> int | None:
    """Rank ``rank``'s partner in round ``t`` of the tournament among ``n`` ranks, or None
    when it sits the round out (odd ``n``)."""
    m = n - 1 if n % 2 == 0 else n
    if rank == m:  # n even: the fixed rank meets the one the circle leaves alone
        return t
    other = (2 * t - rank) % m
    if other != rank:
        return other
    return m if n % 2 == 0 else None


def rounds(n: int) -> int:
    """Rounds in one phase: ``n - 1`` for even ``n``, ``n`` for odd ``n``."""
    return n - 1 if n % 2 == 0 else n


def round_robin(ch: Channel, src: torch.Tensor, out: torch.Tensor, *, mean: bool,
                segment: int | None, window: int) -> None:
    """Allreduce flat ``src`` into flat ``out``, each chunk summed by its owner, pairs
    meeting in round-robin order."""
    n, r = ch.size, ch.rank
    spans = [slice(lo, hi) for lo, hi in chunk_spans(src.numel(), n)]
    opts = {"segment": segment, "window": window, "scratch": Scratch(src)}
    own = spans[r]
    total = rounds(n)
    cur = src
    for t in range(total):
        p = partner(r, n, t)
        if p is None:
            continue
        exchange(ch, f"reduce round {t + 1}/{total}", send=src[spans[p]], send_peer=p,
                 dst=out[own], recv_peer=p, base=cur[own], **opts)
        cur = out
    if mean:
        out[own].div_(n)
    for t in range(total):
        p = partner(r, n, t)
        if p is None:
            continue
        exchange(ch, f"gather round {t + 1}/{total}", send=out[own], send_peer=p,
                 dst=out[spans[p]], recv_peer=p, **opts)
