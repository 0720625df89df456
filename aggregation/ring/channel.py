"""Point-to-point transfers that fail with a named step and peer instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from aggregation.ring.errors import RingError, RingTimeout

Transfer = tuple[torch.Tensor, int]  # (buffer, group rank of the peer)


@dataclass(slots=True)
class Pending:
    """Handles of posted transfers, with what they were for."""

    step: str
    works: list[tuple[dist.Work, str, int]] = field(default_factory=list)


class Channel:
    """Posts isend/irecv on one process group and waits on them with a timeout.

    ``timeout`` (seconds) bounds each wait; ``None`` defers to the process group's
    own timeout. With ``coalesce`` the sends and receives of one :meth:`post` go
    out as one ``batch_isend_irecv`` group (what NCCL needs to avoid deadlock when
    two ranks send to each other); otherwise each is posted on its own.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float | None,
                 coalesce: bool, algorithm: str) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = timeout
        self._wait_arg = None if timeout is None else timedelta(seconds=timeout)
        self._coalesce = coalesce
        self._algorithm = algorithm

    @property
    def coalesce(self) -> bool:
        """Whether one :meth:`post`'s sends and receives go out as one group (NCCL)."""
        return self._coalesce

    def post(self, step: str, sends: Sequence[Transfer] = (),
             recvs: Sequence[Transfer] = ()) -> Pending:
        """Start the given sends and receives; return their handles."""
        pending = Pending(step)
        ops = [(dist.isend, t, p, f"send to rank {p}") for t, p in sends]
        ops += [(dist.irecv, t, p, f"recv from rank {p}") for t, p in recvs]
        if not ops:
            return pending
        what, peer = " and ".join(op[3] for op in ops), ops[0][2]
        try:
            if self._coalesce:
                works = dist.batch_isend_irecv(
                    [dist.P2POp(op, t, group=self.group, group_peer=p) for op, t, p, _ in ops])
                pending.works = [(w, what, peer) for w in works]
            else:
                for op, t, p, desc in ops:
                    what, peer = desc, p
                    key = "group_dst" if op is dist.isend else "group_src"
                    work = op(t, group=self.group, **{key: p})
                    if work is not None:
                        pending.works.append((work, desc, p))
        except RuntimeError as exc:
            raise self._error(step, what, peer, exc, 0.0) from exc
        return pending

    def done(self, pending: Pending) -> bool:
        """Whether every transfer in ``pending`` has finished (errors surface in wait)."""
        return all(work.is_completed() for work, _, _ in pending.works)

    def wait(self, pending: Pending) -> None:
        """Block until every transfer in ``pending`` is done, or raise RingError/RingTimeout."""
        while pending.works:
            work, what, peer = pending.works[0]
            start = time.monotonic()
            try:
                done = work.wait() if self._wait_arg is None else work.wait(self._wait_arg)
            except RuntimeError as exc:
                raise self._error(pending.step, what, peer, exc,
                                  time.monotonic() - start) from exc
            if done is False:
                raise self._error(pending.step, what, peer, None, time.monotonic() - start)
            pending.works.pop(0)

    def _error(self, step: str, what: str, peer: int, cause: BaseException | None,
               elapsed: float) -> RingError:
        text = "" if cause is None else str(cause).strip().splitlines()[0]
        timed_out = cause is None or "timed out" in text.lower() or "timeout" in text.lower()
        where = f"{self._algorithm} allreduce on rank {self.rank}/{self.size}, {step}, {what}"
        if timed_out:
            limit = "the process group timeout" if self.timeout is None else f"{self.timeout:g} s"
            return RingTimeout(f"{where}: no progress within {limit} "
                               f"(waited {elapsed:.1f} s); rank {peer} hangs or is gone. {text}",
                               step=step, peer=peer)
        return RingError(f"{where} failed: {text}", step=step, peer=peer)
