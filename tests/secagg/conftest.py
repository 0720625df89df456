"""Shared helpers for the secure-aggregation tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from privacy.secagg import (
    CLASSIC,
    DEFAULT_POLICY,
    SecAggClient,
    SecAggPolicy,
    SecAggServer,
    SessionParams,
)


class Lockstep:
    """A round driven by hand: server, clients and the server's pending outbox. Its steps
    are the classic flow's stages unless ``flow="merged"`` is given (one step fewer)."""

    def __init__(self, inputs: Sequence[np.ndarray], *,
                 policy: SecAggPolicy = DEFAULT_POLICY, **config_kwargs: object) -> None:
        ids = list(range(1, len(inputs) + 1))
        self.inputs = list(inputs)
        config_kwargs.setdefault("flow", CLASSIC)
        self.config = SessionParams.create(ids, int(inputs[0].size), **config_kwargs)
        self.server = SecAggServer(self.config, policy)
        self.clients = {c: SecAggClient(c, policy=policy) for c in ids}
        for c, x in zip(ids, inputs, strict=True):
            self.clients[c].set_input(x)
        self.outbox = self.server.start()

    def step(self, skip: Sequence[int] = ()) -> dict[int, bytes]:
        """Deliver the outbox, feed replies to the server, close the stage; the replies."""
        replies = {}
        for c, payload in self.outbox.items():
            if c not in skip:
                replies[c] = self.clients[c].handle(payload)
                self.server.receive(c, replies[c])
        self.outbox = self.server.advance()
        return replies

    def deliver(self) -> dict[int, bytes]:
        """Only hand the outbox to the clients; replies are returned, not delivered."""
        return {c: self.clients[c].handle(p) for c, p in self.outbox.items()}


@pytest.fixture
def lockstep() -> Callable[..., Lockstep]:
    return Lockstep


def random_inputs(n: int, dim: int, bits: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = np.uint32 if bits <= 32 else np.uint64
    return [rng.integers(0, 1 << bits, dim, dtype=np.uint64).astype(dtype) for _ in range(n)]


def plain_sum(inputs: Sequence[np.ndarray], ids: Sequence[int], bits: int) -> np.ndarray:
    """Exact sum mod 2^bits of the inputs of clients ``ids`` (1-based), via Python ints."""
    total = [0] * inputs[0].size
    for c in ids:
        for i, v in enumerate(inputs[c - 1].tolist()):
            total[i] += v
    return np.array([v % (1 << bits) for v in total], dtype=np.uint64)


@pytest.fixture
def make_inputs() -> Callable[..., list[np.ndarray]]:
    return random_inputs


@pytest.fixture
def exact_sum() -> Callable[..., np.ndarray]:
    return plain_sum
