"""The client's post-training pipeline: named steps over one trained update, in order.

    pipe = fedring_pipeline(task, config, local=spans, dim=model.dim)
    pipe.names   # ('fedbn_zero', 'local_dp', 'client_momentum', 'tamper', 'client_clip')
    done = pipe.run(PostTraining(delta, metrics, partition_id=pid, seed=seed, state=state))

Each client kind builds its pipeline from the task and the round's config after local
training; a step that does not apply (no FedBN, no local DP, ...) is left out. A step
changes the delta in place or replaces it, and says so in the state's flags: a
``noised`` delta is no longer the trained model less the global one, so a full-weights
reply adds it to the global model instead of sending the trained one. The server's
counterpart is ``aggregation.pipeline``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from aggregation.centered import clip_around
from client.momentum import momentum_update
from client.protocol.train import read_center, read_client_momentum
from client.task import ATTACKER_METRIC, ClientTask
from privacy.dp import local_dp_update

Span = tuple[str, slice]  # (tensor name, its entries in the flat vector)
Tampering = Callable[[int, np.ndarray, int], bool]  # ClientTask.tamper

_NOISE: dict[int, np.random.Generator] = {}


def noise_rng() -> np.random.Generator:
    """This process's generator for DP noise, seeded from OS entropy (again after a fork):
    noise that could be replayed from a seed would protect nothing."""
    pid = os.getpid()
    if pid not in _NOISE:
        _NOISE.clear()
        _NOISE[pid] = np.random.default_rng()
    return _NOISE[pid]


@dataclass
class PostTraining:
    """One update on its way through the steps: the delta (trained less global), the
    reply's metrics, what a step may draw on, and what the steps did to the delta."""

    delta: np.ndarray
    metrics: MutableMapping[str, Any]
    partition_id: int
    seed: int  # the client's training seed of the round (an attack's randomness)
    state: RecordDict  # the node's Context.state (e.g. its momentum)
    noised: bool = False  # the delta is no longer the trained model less the global one
    tampered: bool = False  # a simulated attacker changed it


class Step(Protocol):
    """One named post-training step."""

    name: ClassVar[str]

    def __call__(self, update: PostTraining) -> None: ...


@dataclass(frozen=True)
class FedBNZero:
    """FedBN: the delta is zero on the node's own entries (kept here, never averaged)."""

    local: Sequence[Span]
    name: ClassVar[str] = "fedbn_zero"

    def __call__(self, update: PostTraining) -> None:
        for _, span in self.local:
            update.delta[span] = 0.0


@dataclass(frozen=True)
class LocalDP:
    """Local DP: clip the delta to ``clip``, add N(0, (z clip)^2) noise to each entry."""

    clip: float
    noise_multiplier: float
    rng: np.random.Generator
    name: ClassVar[str] = "local_dp"

    def __call__(self, update: PostTraining) -> None:
        update.delta, _ = local_dp_update(update.delta, self.clip, self.noise_multiplier,
                                          self.rng)
        update.noised = True


@dataclass(frozen=True)
class ClientMomentum:
    """Worker momentum (``client.momentum``): the delta becomes the node's momentum."""

    beta: float
    name: ClassVar[str] = "client_momentum"

    def __call__(self, update: PostTraining) -> None:
        update.delta = momentum_update(update.state, update.delta, self.beta)
        update.noised = True


@dataclass(frozen=True)
class Tamper:
    """A simulated attacker forges its delta in place (the task's ``tamper``); with
    ``mark``, a forged update's metrics say so (``ATTACKER_METRIC``)."""

    tamper: Tampering
    mark: bool = True
    name: ClassVar[str] = "tamper"

    def __call__(self, update: PostTraining) -> None:
        if self.tamper(update.partition_id, update.delta, update.seed):
            update.tampered = update.noised = True
            if self.mark:
                update.metrics[ATTACKER_METRIC] = 1


@dataclass(frozen=True)
class ClientClip:
    """Client-side centered clipping: the delta clipped to ``radius`` around ``center``."""

    center: np.ndarray
    radius: float
    name: ClassVar[str] = "client_clip"

    def __call__(self, update: PostTraining) -> None:
        clip_around(update.delta, self.center, self.radius)
        update.noised = True


class ClientPipeline:
    """Post-training steps applied in order (``None`` entries are steps left out)."""

    def __init__(self, steps: Iterable[Step | None]) -> None:
        self.steps: tuple[Step, ...] = tuple(s for s in steps if s is not None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(step.name for step in self.steps)

    def run(self, update: PostTraining) -> PostTraining:
        for step in self.steps:
            step(update)
        return update


def _fedbn(local: Sequence[Span] | None) -> FedBNZero | None:
    return None if local is None else FedBNZero(local)


def _local_dp(task: ClientTask) -> LocalDP | None:
    return None if task.local_dp is None else LocalDP(*task.local_dp, noise_rng())


def fedring_pipeline(task: ClientTask, config: ConfigRecord, *, local: Sequence[Span] | None,
                     dim: int) -> ClientPipeline:
    """fedring's client: fedbn_zero -> local_dp -> client_momentum -> tamper ->
    client_clip (``local``: FedBN's spans, None without FedBN; momentum and centre from
    the train config, WireError when malformed)."""
    beta = read_client_momentum(config)
    center = read_center(config, dim)
    return ClientPipeline([
        _fedbn(local), _local_dp(task), ClientMomentum(beta) if beta else None,
        Tamper(task.tamper), None if center is None else ClientClip(*center)])


def silo_pipeline(task: ClientTask, *, local: Sequence[Span] | None) -> ClientPipeline:
    """A silo: fedbn_zero -> local_dp -> tamper. A silo applies no worker momentum and no
    client-side clipping, and its metrics do not mark a forged update."""
    return ClientPipeline([_fedbn(local), _local_dp(task), Tamper(task.tamper, mark=False)])
