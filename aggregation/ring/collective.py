"""The public entry points: :func:`allreduce` and :func:`weighted_mean`."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from aggregation.ring.alltoall import all_to_all
from aggregation.ring.channel import Channel, Pending
from aggregation.ring.halving import halving_doubling
from aggregation.ring.master import reduce_broadcast
from aggregation.ring.names import ALGORITHMS, Algorithm
from aggregation.ring.ring import ring_pipelined, ring_stepwise
from aggregation.ring.round_robin import round_robin
from aggregation.ring.tree import recursive_doubling

Op = Literal["sum", "mean"]

DEFAULT_SEGMENT_BYTES = 16 << 20
DEFAULT_WINDOW = 4

# Unsigned types torch cannot add are carried as the signed type of the same width:
# two's-complement addition gives the same bits, i.e. the sum modulo 2^b.
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
_INTEGER = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *_SIGNED_TWIN}


def _check_dtype(dtype: torch.dtype, op: str) -> None:
    if not (dtype.is_floating_point or dtype in _INTEGER):
        raise TypeError(f"allreduce supports floating and integer tensors, not {dtype}")
    if op == "mean" and not dtype.is_floating_point:
        raise TypeError(f"op='mean' needs a floating tensor, got {dtype}; use op='sum'")


def _backend_of(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> str:
    """'nccl' when the tensor will travel over NCCL, else 'gloo' (or the group's name)."""
    name = str(dist.get_backend(group)).lower()
    if tensor.is_cuda and "nccl" in name:
        return "nccl"
    if not tensor.is_cuda and name == "nccl":
        raise TypeError("a CPU tensor cannot go through an NCCL-only group; move it to CUDA")
    return "gloo" if "gloo" in name else name


def allreduce(
    tensor: torch.Tensor,
    *,
    op: Op = "sum",
    algorithm: Algorithm = "ring",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    window: int = DEFAULT_WINDOW,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all ranks of ``group``; return the result.

    Every rank must call it with a tensor of the same shape and dtype. The result
    goes to ``out`` if given (a contiguous tensor of the same shape, dtype and
    device; ``out=tensor`` reduces in place like ``dist.all_reduce``), otherwise
    to a new tensor; ``tensor`` itself is only modified when it is ``out``. The
    result is bit-identical on all ranks for every algorithm.

    algorithm: ``"ring"`` (reduce-scatter + all-gather over isend/irecv),
      ``"tree"`` (recursive doubling), ``"halving_doubling"`` (Rabenseifner:
      recursive-halving reduce-scatter + recursive-doubling all-gather),
      ``"all_to_all"`` (each chunk summed by its owner rank, then sent to all),
      ``"round_robin"`` (the same, pairs of ranks swapping chunks in the rounds of a
      round-robin tournament),
      ``"master"`` (reduce to rank 0, then broadcast), ``"native"``
      (``dist.all_reduce``).
    op: ``"sum"`` or ``"mean"`` (floating tensors only).
    dtypes: float16/bfloat16/float32/float64 accumulate in their own dtype, one
      rounding per add, as NCCL does. Integers (int8..int64, uint8..uint64) wrap
      modulo 2^bits, so masked updates sum correctly.
    timeout: seconds to wait for any one transfer before raising
      :class:`RingTimeout`; ``None`` uses the process group's timeout. A peer that
      dies raises :class:`RingError` naming the step and the peer.
    segment_bytes: transfers are cut into segments of about this size and
      pipelined, up to ``window`` segments in flight; ``None`` sends whole
      chunks, one ring step after another (the textbook, unpipelined form).
      On gloo the schedules other than the pipelined ring cut segments to
      ``aggregation.ring.exchange.SEGMENT_CAP_BYTES`` (the kernel's largest TCP
      send buffer), with as many more in flight, so that a send fits the socket
      of the thread that posts it. Ignored on NCCL, which moves whole chunks in
      grouped send/receive pairs.

    CUDA tensors use NCCL when the group has it; on a gloo-only group they are
    staged through host memory.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"segment_bytes must be positive or None, got {segment_bytes}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    _check_dtype(tensor.dtype, op)
    if dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the group")
    if out is None:
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    elif (out.shape != tensor.shape or out.dtype != tensor.dtype
          or out.device != tensor.device or not out.is_contiguous()):
        raise ValueError("out must be a contiguous tensor with the shape, dtype and device "
                         f"of tensor ({tuple(tensor.shape)}, {tensor.dtype}, {tensor.device})")
    backend = _backend_of(tensor, group)
    if tensor.is_cuda and backend != "nccl":
        host = tensor.detach().to("cpu")
        allreduce(host, op=op, algorithm=algorithm, group=group, timeout=timeout,
                  segment_bytes=segment_bytes, window=window, out=host)
        return out.copy_(host)

    signed = _SIGNED_TWIN.get(tensor.dtype, tensor.dtype)
    src = tensor.detach().contiguous().reshape(-1).view(signed)
    dst = out.detach().reshape(-1).view(signed)
    nccl = backend == "nccl"
    ch = Channel(group, timeout=timeout, coalesce=nccl, algorithm=algorithm)
    mean = op == "mean"
    if algorithm == "native":
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        if ch.size > 1 and dst.numel() > 0:
            pending = Pending("all_reduce")
            work = dist.all_reduce(dst, group=group, async_op=True)
            pending.works.append((work, "dist.all_reduce", -1))
            ch.wait(pending)
        if mean:
            dst.div_(ch.size)
    elif ch.size == 1 or src.numel() == 0:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        if mean:
            dst.div_(ch.size)
    else:
        segment = None
        if segment_bytes is not None and not nccl:
            segment = max(1, segment_bytes // src.element_size())
        opts = {"mean": mean, "segment": segment, "window": window}
        if algorithm == "ring" and segment is not None:
            ring_pipelined(ch, src, dst, mean=mean, segment=segment, window=window)
        elif algorithm == "ring":
            ring_stepwise(ch, src, dst, **opts)
        else:
            schedules = {"tree": recursive_doubling, "master": reduce_broadcast,
                         "halving_doubling": halving_doubling, "all_to_all": all_to_all,
                         "round_robin": round_robin}
            schedules[algorithm](ch, src, dst, **opts)
    return out


def weighted_mean(
    tensor: torch.Tensor,
    weight: float | torch.Tensor,
    *,
    algorithm: Algorithm = "ring",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` over the ranks of ``group``, in one allreduce.

    The weighted vector and the weight travel together (the weight as one extra
    element), in float64 for float64 inputs and float32 otherwise; the result is
    cast back to ``tensor``'s dtype. Raises ``ValueError`` if the weights sum to 0.
    """
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"weighted_mean needs a floating tensor, got {tensor.dtype}")
    w = float(weight)
    if w != w or w in (float("inf"), float("-inf")):
        raise ValueError(f"weight must be finite, got {w}")
    acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    numel = tensor.numel()
    buf = torch.empty(numel + 1, dtype=acc, device=tensor.device)
    buf[:numel].copy_(tensor.detach().reshape(-1)).mul_(w)  # multiply in acc, not in dtype
    buf[numel] = w
    total = allreduce(buf, op="sum", algorithm=algorithm, group=group, timeout=timeout,
                      segment_bytes=segment_bytes)
    weight_sum = float(total[numel])
    if weight_sum == 0.0:
        raise ValueError("weights sum to zero across ranks; the weighted mean is undefined")
    return (total[:numel] / weight_sum).to(tensor.dtype).reshape(tensor.shape)
