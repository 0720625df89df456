"""Functions the ring tests run on every rank of a launched process group.

Each returns small, picklable summaries (lists of failure descriptions, digests)
so the test process can assert on them.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

import aggregation.ring.exchange as exchange_module
from aggregation.ring import RingError, RingTimeout, allreduce, exchange, weighted_mean
from aggregation.ring.alltoall import all_to_all
from aggregation.ring.channel import Channel, Pending
from aggregation.ring.halving import halving_doubling
from aggregation.ring.master import reduce_broadcast
from aggregation.ring.ring import ring_stepwise
from aggregation.ring.round_robin import round_robin
from aggregation.ring.tree import recursive_doubling

LENGTHS = (0, 1, 7, 10_007, 2**20 + 3)
VARIANT_LENGTH = 10_007  # many 4 KiB segments per chunk, unequal chunks, still quick
ALGORITHMS = ("ring", "tree", "master", "native")
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTEGERS = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.uint32)
# The longest length runs with these; every dtype runs at the shorter ones.
BIG_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
GROUPED = {"ring": ring_stepwise, "tree": recursive_doubling, "master": reduce_broadcast}
MOD32 = (1 << 32) - 1


def make_data(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per-rank data; integers span their full range so sums overflow."""
    seed = 1_000_003 * rank + 7919 * length + (FLOATS + INTEGERS).index(dtype)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (4 * torch.randn(length, generator=g)).to(dtype)
    if dtype == torch.uint32:
        return torch.randint(0, 1 << 32, (length,), generator=g).to(torch.uint32)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (length,), generator=g, dtype=torch.int64).to(dtype)


def native_sum(x: torch.Tensor) -> torch.Tensor:
    """Reference sum by dist.all_reduce (int16/uint32 via a type gloo supports, same bits)."""
    if x.dtype == torch.uint32:
        return native_sum(x.view(torch.int32)).view(torch.uint32)
    if x.dtype == torch.int16:
        return native_sum(x.to(torch.int32)).to(torch.int16)
    ref = x.clone()
    dist.all_reduce(ref)
    return ref


def float_error(result: torch.Tensor, reference: torch.Tensor, abs_sum: torch.Tensor,
                n: int) -> str | None:
    """Why ``result`` is not within reordering error of ``reference``, or None.

    Summing ``n`` values in any order is off by at most ``(n - 1) u sum|x_i|``
    (``u`` = eps/2) plus one final rounding; allow that twice over, both results
    being rounded.
    """
    eps = torch.finfo(result.dtype).eps
    tiny = torch.finfo(result.dtype).tiny
    bound = 2 * n * eps * abs_sum.double() + tiny
    diff = (result.double() - reference.double()).abs()
    if result.shape != reference.shape or result.dtype != reference.dtype:
        return f"shape/dtype {tuple(result.shape)}/{result.dtype} != reference"
    bad = diff > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        return (f"{int(bad.sum())} elements off, first at {i}: {float(result[i])} vs "
                f"{float(reference[i])} (bound {float(bound[i]):.3g})")
    return None


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def _grouped(alg: str, x: torch.Tensor) -> torch.Tensor:
    """Run the NCCL-style schedule (whole messages, batched send/recv) on gloo."""
    out = torch.empty_like(x)
    if dist.get_world_size() == 1 or x.numel() == 0:
        return out.copy_(x)
    ch = Channel(None, timeout=60.0, coalesce=True, algorithm=alg)
    GROUPED[alg](ch, x, out, mean=False, segment=None, window=1)
    return out


def _in_place(alg: str, x: torch.Tensor, **opts: object) -> torch.Tensor:
    """allreduce(y, out=y) must fill y itself and return it."""
    y = x.clone()
    out = allreduce(y, algorithm=alg, out=y, **opts)
    return y if out is y else torch.full_like(y, float("nan"))


SEGMENT = 1024  # float32 elements in the 4 KiB segments below


def segment_edges(rank: int, n: int) -> dict[str, object]:
    """The pipelined ring where neighbouring chunks have different segment counts, and
    the scratch it takes for a vector of many segments per chunk."""
    fails = []
    # n * SEGMENT + 1: chunk 0 has two segments, the others one
    for length in (n * SEGMENT + 1, n * SEGMENT - 1, 3 * n * SEGMENT + n // 2):
        x = make_data(rank, length, torch.float32)
        ref = native_sum(x)
        abs_sum = native_sum(x.double().abs())
        for window in (1, 3):
            for place, fn in (("out of place", allreduce), ("in place", _in_place)):
                args = (x,) if fn is allreduce else ("ring", x)
                got = fn(*args, segment_bytes=4 * SEGMENT, window=window)
                why = float_error(got, ref, abs_sum, n)
                if why:
                    fails.append(f"L={length} window={window} {place}: {why}")
    per_chunk, window = 32, 3
    cache = exchange._pool.__dict__.setdefault("buffers", {})
    cache.clear()
    x = make_data(rank, n * per_chunk * SEGMENT, torch.float32)
    allreduce(x, segment_bytes=4 * SEGMENT, window=window)
    return {"fails": fails, "slots": len(cache), "bound": per_chunk + window + 1}


def sweep(rank: int, n: int) -> dict[str, object]:
    """Every algorithm x length x dtype (and variants) against dist.all_reduce."""
    fails: dict[str, list[str]] = {k: [] for k in ("float", "int", "variant", "input", "calls")}
    digests: dict[str, str] = {}

    def run(key: str, fn: Callable[..., torch.Tensor], *args: object,
            **kwargs: object) -> torch.Tensor | None:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            fails["calls"].append(f"{key}: {type(exc).__name__}: {exc}")
            return None
        digests[key] = digest(result)
        return result

    for length in LENGTHS:
        for dtype in FLOATS + INTEGERS:
            if length > VARIANT_LENGTH and dtype not in BIG_DTYPES:
                continue
            x = make_data(rank, length, dtype)
            keep = x.clone()
            ref = native_sum(x)
            abs_sum = native_sum(x.double().abs()) if dtype.is_floating_point else None
            for alg in ALGORITHMS:
                if alg == "native" and dtype == torch.int16:
                    continue  # gloo has no int16 sum
                key = f"{alg}/{dtype}/L={length}"
                results = {key: run(key, allreduce, x, algorithm=alg)}
                if not torch.equal(x, keep):
                    fails["input"].append(f"{key}: input was modified")
                if dtype in (torch.float32, torch.int32) and alg != "native":
                    variants = [("unpipelined", {"segment_bytes": None})]
                    if length <= VARIANT_LENGTH:
                        variants.append(("segments=4KiB", {"segment_bytes": 4096, "window": 3}))
                        variants.append(("window=64", {"segment_bytes": 4096, "window": 64}))
                    for name, opts in variants:
                        vkey = f"{key}/{name}"
                        results[vkey] = run(vkey, allreduce, x, algorithm=alg, **opts)
                    results[f"{key}/grouped"] = run(f"{key}/grouped", _grouped, alg, x)
                if dtype == torch.float32:
                    results[f"{key}/in-place"] = run(f"{key}/in-place", _in_place, alg, x)
                    if length <= VARIANT_LENGTH:
                        for window in (1, 3):
                            ikey = f"{key}/in-place/segments=4KiB/window={window}"
                            results[ikey] = run(ikey, _in_place, alg, x,
                                                segment_bytes=4096, window=window)
                for k, result in results.items():
                    if result is None:
                        continue
                    if dtype.is_floating_point:
                        why = float_error(result, ref, abs_sum, n)
                        if why:
                            (fails["variant"] if k != key else fails["float"]).append(f"{k}: {why}")
                    elif not torch.equal(result, ref):
                        bad = int((result != ref).sum())
                        (fails["variant"] if k != key else fails["int"]).append(
                            f"{k}: {bad} of {length} elements differ from dist.all_reduce")
            if dtype in (torch.float32, torch.bfloat16) and length > 0:
                for alg in ALGORITHMS:
                    key = f"{alg}/{dtype}/L={length}/mean"
                    result = run(key, allreduce, x, op="mean", algorithm=alg)
                    if result is not None:
                        why = float_error(result, (ref.double() / n).to(dtype), abs_sum / n, n)
                        if why:
                            fails["variant"].append(f"{key}: {why}")
    # A transposed (non-contiguous) 2-D input comes back in its own shape.
    m = make_data(rank, 6 * 1001, torch.float32).view(6, 1001).t()
    ref = native_sum(m.contiguous())
    for alg in ALGORITHMS:
        result = run(f"{alg}/non-contiguous", allreduce, m, algorithm=alg)
        if result is not None:
            why = float_error(result, ref, native_sum(m.contiguous().double().abs()), n)
            if why:
                fails["variant"].append(f"{alg}/non-contiguous: {why}")
    return {"fails": fails, "digests": digests}


def pairwise_mask(rank: int, n: int, length: int) -> torch.Tensor:
    """Sum over peers j of +m_ij (rank < j) or -m_ij (rank > j); these cancel mod 2^32."""
    mask = torch.zeros(length, dtype=torch.int64)
    for j in range(n):
        if j == rank:
            continue
        lo, hi = min(rank, j), max(rank, j)
        g = torch.Generator().manual_seed(10_007 * lo + hi)
        m = torch.randint(0, 1 << 32, (length,), generator=g)
        mask += m if rank < j else -m
    return mask


def masked(rank: int, n: int) -> dict[str, list[str]]:
    """Pairwise-masked integer vectors summed with wrap-around unmask to the plain sum."""
    fails: list[str] = []
    checks = 0
    for length in (1, 4099, 2**16 + 1):
        plains = [torch.randint(0, 1 << 20, (length,), generator=torch.Generator().manual_seed(r))
                  for r in range(n)]
        expected = torch.stack(plains).sum(0) & MOD32
        enc = (plains[rank] + pairwise_mask(rank, n, length)) & MOD32  # uint32 values in int64
        if n > 1 and torch.equal(enc, plains[rank]):
            fails.append(f"L={length}: the mask did not change the data")
        as_int32 = enc.to(torch.int32)  # keeps the low 32 bits
        inputs = {"int32": as_int32, "uint32": as_int32.view(torch.uint32), "int64": enc}
        for alg in ALGORITHMS:
            for name, data in inputs.items():
                if name == "uint32" and alg == "native":
                    continue  # gloo has no uint32 sum
                checks += 1
                got = allreduce(data, algorithm=alg).to(torch.int64) & MOD32
                if not torch.equal(got, expected):
                    fails.append(f"{alg}/{name}/L={length}: {int((got != expected).sum())} "
                                 "elements differ from the plain sum mod 2^32")
    return {"fails": fails, "checks": [str(checks)]}


def weighted(rank: int, n: int) -> dict[str, list[str]]:
    """weighted_mean against sum(w x)/sum(w) computed from every rank's data."""
    fails: list[str] = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for length in (1, 7, 50_001):
            xs = [make_data(r, length, dtype) for r in range(n)]
            ws = [r + 1.5 for r in range(n)]
            expected = sum(w * x.double() for w, x in zip(ws, xs, strict=True)) / sum(ws)
            scale = sum(w * x.double().abs() for w, x in zip(ws, xs, strict=True)) / sum(ws)
            acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
            # One rounding to dtype at the end, plus the accumulation error of the sum.
            bound = torch.finfo(dtype).eps * expected.abs() + 2 * (n + 1) * acc_eps * scale
            for alg in ALGORITHMS:
                try:
                    got = weighted_mean(xs[rank], ws[rank], algorithm=alg)
                except Exception as exc:
                    fails.append(f"{alg}/{dtype}/L={length}: {type(exc).__name__}: {exc}")
                    continue
                err = (got.double() - expected).abs()
                if got.dtype != dtype or bool((err > bound + 1e-30).any()):
                    fails.append(f"{alg}/{dtype}/L={length}: weighted mean off "
                                 f"(max err {float(err.max()):.3g})")
    try:
        weighted_mean(torch.ones(3), rank - (n - 1) / 2)
        fails.append("weights summing to zero did not raise")
    except ValueError:
        pass
    return {"fails": fails}


def bad_arguments(rank: int, n: int) -> list[str]:
    """Bad arguments raise the documented errors (before any communication)."""
    x = torch.ones(4)
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: allreduce(x, algorithm="bogus")),  # type: ignore[arg-type]
        (ValueError, lambda: allreduce(x, op="max")),  # type: ignore[arg-type]
        (TypeError, lambda: allreduce(torch.ones(4, dtype=torch.bool))),
        (TypeError, lambda: allreduce(torch.ones(4, dtype=torch.complex64))),
        (TypeError, lambda: allreduce(torch.ones(4, dtype=torch.int32), op="mean")),
        (TypeError, lambda: weighted_mean(torch.ones(4, dtype=torch.int32), 1.0)),
        (ValueError, lambda: weighted_mean(x, float("nan"))),
        (ValueError, lambda: allreduce(x, out=torch.empty(5))),
        (ValueError, lambda: allreduce(x, out=torch.empty(4, dtype=torch.float64))),
        (ValueError, lambda: allreduce(x, segment_bytes=0)),
        (ValueError, lambda: allreduce(x, window=0)),
        (ValueError, lambda: allreduce(x, timeout=-1.0)),
    ]
    fails = []
    for i, (expected, fn) in enumerate(cases):
        try:
            fn()
            fails.append(f"case {i}: no {expected.__name__}")
        except expected:
            pass
        except Exception as exc:
            fails.append(f"case {i}: {type(exc).__name__} instead of {expected.__name__}: {exc}")
    return fails


def survive_failure(rank: int, n: int, victim: int, mode: str, algorithm: str,
                    timeout: float) -> dict[str, object] | str:
    """The victim dies (os._exit mid-collective) or hangs; the others must raise in time."""
    x = torch.randn(1 << 20)
    allreduce(x, algorithm=algorithm)  # a first collective that succeeds everywhere
    if rank == victim:
        if mode == "hang":
            time.sleep(timeout + 3)
            return "hung"

        def die() -> None:
            time.sleep(0.2)
            os._exit(17)

        threading.Thread(target=die, daemon=True).start()
    for calls in range(10_000):
        start = time.monotonic()
        try:
            allreduce(x, algorithm=algorithm, timeout=timeout)
        except RingError as exc:
            return {"type": type(exc).__name__, "timeout": isinstance(exc, RingTimeout),
                    "step": exc.step, "peer": exc.peer, "message": str(exc),
                    "seconds": time.monotonic() - start, "calls": calls}
    return "completed"


def unpipelined_mean(rank: int, n: int) -> list[str]:
    """op="mean" on the unpipelined schedules (whole chunks, one step after another; grouped
    as NCCL runs them) against the mean of every rank's data computed here in float64."""
    fails: list[str] = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for length in sorted({1, max(1, n - 1), n + 1, 7, VARIANT_LENGTH}):
            xs = [make_data(r, length, dtype) for r in range(n)]
            ref = (sum(x.double() for x in xs) / n).to(dtype)
            abs_mean = sum(x.double().abs() for x in xs) / n
            runs: dict[str, Callable[[], torch.Tensor]] = {
                "ring/unpipelined": lambda x=xs[rank]: allreduce(
                    x, op="mean", algorithm="ring", segment_bytes=None)}
            for alg, schedule in GROUPED.items():
                def grouped(x: torch.Tensor = xs[rank], schedule=schedule,
                            alg: str = alg) -> torch.Tensor:
                    out = torch.empty_like(x)
                    ch = Channel(None, timeout=60.0, coalesce=True, algorithm=alg)
                    schedule(ch, x, out, mean=True, segment=None, window=1)
                    return out
                runs[f"{alg}/grouped"] = grouped
            for name, call in runs.items():
                key = f"{name}/{dtype}/L={length}"
                try:
                    result = call()
                except Exception as exc:
                    fails.append(f"{key}: {type(exc).__name__}: {exc}")
                    continue
                why = float_error(result, ref, abs_mean, n)
                if why:
                    fails.append(f"{key}: {why}")
    return fails


FAMILY = ("halving_doubling", "all_to_all", "round_robin")
FAMILY_SCHEDULES = {"halving_doubling": halving_doubling, "all_to_all": all_to_all,
                    "round_robin": round_robin}
FAMILY_LENGTHS = (0, 1, 7, VARIANT_LENGTH, 2**20 + 3)
FAMILY_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64,
                 torch.int8, torch.uint8, torch.uint32)
# The longest length runs with these; the others run at the shorter ones.
FAMILY_BIG = (torch.float32, torch.int64, torch.uint32)


def _family_grouped(alg: str, x: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """The NCCL-style schedule (whole messages, batched send/recv) on gloo."""
    out = torch.empty_like(x)
    if dist.get_world_size() == 1 or x.numel() == 0:
        return out.copy_(x) if not mean else out.copy_(x).div_(dist.get_world_size())
    ch = Channel(None, timeout=60.0, coalesce=True, algorithm=alg)
    FAMILY_SCHEDULES[alg](ch, x.view(torch.int32) if x.dtype == torch.uint32 else x,
                          out.view(torch.int32) if x.dtype == torch.uint32 else out,
                          mean=mean, segment=None, window=1)
    return out


def family(rank: int, n: int) -> dict[str, object]:
    """halving_doubling, all_to_all and round_robin against dist.all_reduce: every length
    and dtype, segmented, unpipelined, grouped, in place and mean variants, and pairwise-masked
    integers whose sums wrap. Failures are keyed by algorithm."""
    fails: dict[str, list[str]] = {alg: [] for alg in FAMILY}
    digests: dict[str, dict[str, str]] = {alg: {} for alg in FAMILY}

    def check(alg: str, key: str, call: Callable[[], torch.Tensor], ref: torch.Tensor,
              abs_sum: torch.Tensor | None) -> None:
        try:
            result = call()
        except Exception as exc:
            fails[alg].append(f"{key}: {type(exc).__name__}: {exc}")
            return
        digests[alg][key] = digest(result)
        if abs_sum is not None:
            why = float_error(result, ref, abs_sum, n)
            if why:
                fails[alg].append(f"{key}: {why}")
        elif result.dtype != ref.dtype or not torch.equal(result, ref):
            bad = int((result != ref).sum()) if result.shape == ref.shape else -1
            fails[alg].append(f"{key}: {bad} of {ref.numel()} elements differ from native")

    for length in FAMILY_LENGTHS:
        for dtype in FAMILY_DTYPES:
            if length > VARIANT_LENGTH and dtype not in FAMILY_BIG:
                continue
            x = make_data(rank, length, dtype)
            keep = x.clone()
            ref = native_sum(x)
            abs_sum = native_sum(x.double().abs()) if dtype.is_floating_point else None
            for alg in FAMILY:
                key = f"{dtype}/L={length}"
                check(alg, key, partial(allreduce, x, algorithm=alg), ref, abs_sum)
                if not torch.equal(x, keep):
                    fails[alg].append(f"{key}: input was modified")
                if dtype not in (torch.float32, torch.int64, torch.uint32):
                    continue
                variants: dict[str, Callable[[], torch.Tensor]] = {
                    "unpipelined": partial(allreduce, x, algorithm=alg, segment_bytes=None),
                    "grouped": partial(_family_grouped, alg, x),
                    "in-place": partial(_in_place, alg, x),
                }
                if length <= VARIANT_LENGTH:
                    variants["segments=4KiB"] = partial(
                        allreduce, x, algorithm=alg, segment_bytes=4096, window=3)
                    variants["in-place/segments=4KiB"] = partial(
                        _in_place, alg, x, segment_bytes=4096, window=1)
                for name, call in variants.items():
                    check(alg, f"{key}/{name}", call, ref, abs_sum)
                if dtype == torch.float32 and length > 0:
                    mean_ref = (ref.double() / n).to(dtype)
                    check(alg, f"{key}/mean", partial(allreduce, x, op="mean", algorithm=alg),
                          mean_ref, abs_sum / n)
                    check(alg, f"{key}/grouped-mean",
                          partial(_family_grouped, alg, x, mean=True), mean_ref, abs_sum / n)
    for length in (1, 7, 2**16 + 1):
        plains = [torch.randint(0, 1 << 20, (length,), generator=torch.Generator().manual_seed(r))
                  for r in range(n)]
        expected = torch.stack(plains).sum(0) & MOD32
        enc = (plains[rank] + pairwise_mask(rank, n, length)) & MOD32
        inputs = {"int32": enc.to(torch.int32), "uint32": enc.to(torch.int32).view(torch.uint32),
                  "int64": enc}
        for alg in FAMILY:
            for name, data in inputs.items():
                got = allreduce(data, algorithm=alg).to(torch.int64) & MOD32
                if not torch.equal(got, expected):
                    fails[alg].append(f"masked {name}/L={length}: {int((got != expected).sum())} "
                                      "elements differ from the plain sum mod 2^32")
    sent = {alg: _elements_sent(alg) for alg in FAMILY}
    segments = {alg: _segments(alg) for alg in (*FAMILY, "tree", "master")}
    return {"fails": fails, "digests": digests, "sent": sent, "segments": segments,
            "peers": _peers("round_robin")}


def _posted(alg: str, length: int = 840 * 7) -> list[tuple[str, list[tuple[int, int]],
                                                         list[int]]]:
    """(step, [(send peer, elements)], receive peers) of every transfer this rank posts in
    one allreduce of ``length`` float32 (whole messages)."""
    posts: list[tuple[str, list[tuple[int, int]], list[int]]] = []
    post = Channel.post

    def recording(self: Channel, step: str, sends: Sequence = (),
                  recvs: Sequence = ()) -> Pending:
        posts.append((step, [(p, t.numel()) for t, p in sends], [p for _, p in recvs]))
        return post(self, step, sends, recvs)

    Channel.post = recording  # type: ignore[method-assign]
    try:
        allreduce(torch.ones(length), algorithm=alg, segment_bytes=None)
    finally:
        Channel.post = post  # type: ignore[method-assign]
    return posts


def _peers(alg: str) -> list[tuple[str, list[int], list[int]]]:
    """(step, send peers, receive peers) of every transfer this rank posts."""
    return [(step, [p for p, _ in sends], recvs) for step, sends, recvs in _posted(alg)]


SEGMENT_CAP = 1 << 16  # bytes: the cap _segments puts in place of the socket's


def _segments(alg: str) -> tuple[int, int]:
    """(largest message, most bytes posted to one peer and not yet waited for) of this
    rank in one allreduce of 16 * SEGMENT_CAP bytes of float32 asked for in segments of
    4 * SEGMENT_CAP, 2 in flight, with the gloo segment cap set to SEGMENT_CAP."""
    outstanding: dict[int, int] = {}
    per_pending: dict[int, list[tuple[int, int]]] = {}
    largest = biggest = 0
    post, wait = Channel.post, Channel.wait
    cap = exchange_module.SEGMENT_CAP_BYTES

    def counting_post(self: Channel, step: str, sends: Sequence = (), recvs: Sequence = (),
                      **kw: object) -> Pending:
        nonlocal largest, biggest
        pending = post(self, step, sends, recvs, **kw)
        per_pending[id(pending)] = [(p, t.numel() * t.element_size()) for t, p in sends]
        for p, nbytes in per_pending[id(pending)]:
            outstanding[p] = outstanding.get(p, 0) + nbytes
            largest = max(largest, outstanding[p])
            biggest = max(biggest, nbytes)
        return pending

    def counting_wait(self: Channel, pending: Pending) -> None:
        wait(self, pending)
        for p, nbytes in per_pending.pop(id(pending), []):
            outstanding[p] -= nbytes

    Channel.post, Channel.wait = counting_post, counting_wait  # type: ignore[method-assign]
    exchange_module.SEGMENT_CAP_BYTES = SEGMENT_CAP
    try:
        allreduce(torch.ones(16 * SEGMENT_CAP // 4), algorithm=alg,
                  segment_bytes=4 * SEGMENT_CAP, window=2)
    finally:
        Channel.post, Channel.wait = post, wait  # type: ignore[method-assign]
        exchange_module.SEGMENT_CAP_BYTES = cap
    return biggest, largest


def _elements_sent(alg: str) -> int:
    """Elements this rank sends in one allreduce (whole messages)."""
    return sum(n for _, sends, _ in _posted(alg) for _, n in sends)
