"""FedBuff's buffers behind one interface: replies in until the buffer is full, then one
aggregate out as a round result.

:class:`PlainBuffer` decodes each reply and sums the updates in the clear;
``server.secure_buffer.SecureBuffer`` lets each client keep its update and sums the
buffer under SecAgg+. ``server.fedbuff`` sees only :class:`ReplyBuffer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from flwr.app import Message

from aggregation import Pipeline, Update
from client.protocol.errors import WireError
from server.inflight import Task
from server.rounds import RoundResult, mean_loss, update_record
from server.store import UpdateRecord


class ReplyBuffer(Protocol):
    """A buffer of ``size`` updates opened at model ``version``."""

    size: int
    version: int

    @property
    def members(self) -> set[str]:
        """Clients with an update in the buffer (none is given a second task for it)."""
        ...

    @property
    def filled(self) -> int:
        """Updates in the buffer so far."""
        ...

    @property
    def full(self) -> bool:
        ...

    def admit(self, task: Task, reply: Message) -> UpdateRecord | None:
        """``task``'s reply: its record (accepted or rejected), or None when its update
        joined the buffer and its record comes with the aggregate."""
        ...

    def figures(self) -> dict[str, float]:
        """The buffer's own figures: its updates' mean staleness and training loss."""
        ...

    def close(self, run_id: str, rnd: int) -> RoundResult:
        """The buffer's aggregate as round ``rnd``'s result, with the records that only
        the aggregate brings (the round's counts and the other records are the caller's)."""
        ...


class PlainBuffer:
    """Decodes each reply with ``decode`` (raising ``WireError`` on a bad one) and sums
    the updates in the clear through the pipeline."""

    def __init__(self, pipeline: Pipeline, decode: Callable[[Task, Message], Update], *,
                 dim: int, version: int, size: int, by_examples: bool,
                 rescale: bool = True) -> None:
        self.agg = pipeline.open_round(dim=dim, version=version)
        self.decode = decode
        self.size = size
        self.rescale = rescale
        self.version = version
        self.members: set[str] = set()
        self.base_total = 0.0  # sum of weights before staleness scaling
        self._by_examples = by_examples
        self._staleness: list[int] = []
        self._losses: list[tuple[float, float]] = []

    @property
    def filled(self) -> int:
        return self.agg.num_accepted

    @property
    def full(self) -> bool:
        return self.agg.num_accepted >= self.size

    def admit(self, task: Task, reply: Message) -> UpdateRecord:
        client_id = str(task.node)
        try:
            update = self.decode(task, reply)
        except WireError as exc:
            return update_record(self.agg.reject(client_id, str(exc)))
        verdict = self.agg.submit(update)
        if verdict.accepted:
            self.members.add(update.client_id)
            self.base_total += float(update.num_examples) if self._by_examples else 1.0
            self._staleness.append(int(verdict.staleness or 0))
            if "train_loss" in update.metrics:
                self._losses.append((update.metrics["train_loss"], float(update.num_examples)))
        return update_record(verdict, update.metrics)

    def figures(self) -> dict[str, float]:
        return {**staleness_mean(self._staleness), **mean_loss(self._losses)}

    def close(self, run_id: str, rnd: int) -> RoundResult:
        """The combined delta ("failed" with a note when the combine refuses the buffer)."""
        note = None
        try:
            delta = self._combined()
        except ValueError as exc:  # e.g. a robust combine refusing the buffer
            delta, note = None, f"aggregation failed: {exc}"
        return RoundResult(aggregate=delta, status="completed" if delta is not None
                           else "failed", records=[], num_sampled=0, num_replies=0,
                           total_weight=self.agg.total_weight, count=self.agg.num_accepted,
                           note=note)

    def _combined(self) -> np.ndarray | None:
        """The combined delta; a weighted mean is rescaled to sum(b s delta) / sum(b)."""
        delta = self.agg.finish()
        if (self.rescale and delta is not None and self.agg.combine.normalized
                and self.base_total > 0 and self.agg.total_weight != self.base_total):
            delta *= np.float32(self.agg.total_weight / self.base_total)
        return delta


def staleness_mean(staleness: list[int]) -> dict[str, float]:
    """``{"staleness_mean": ...}`` over a buffer's updates, if any."""
    return {"staleness_mean": float(np.mean(staleness))} if staleness else {}
