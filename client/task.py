"""What a ClientApp needs to know about the learning task; supplied by the caller."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from client.training import TrainConfig

ATTACKER_METRIC = "attacker"  # reply metric: 1 when this client is a simulated attacker

# A task's own loops: (module, partition id, seed) -> (examples, metrics) for training,
# (module, partition id) -> (examples, metrics) for evaluation.
LocalTrain = Callable[[torch.nn.Module, int, int], tuple[int, dict[str, float]]]
LocalEvaluate = Callable[[torch.nn.Module, int], tuple[int, dict[str, float]]]


class ClientTask(Protocol):
    """A model factory, the client's partition and its training settings."""

    train_config: TrainConfig
    seed: int
    local_dp: tuple[float, float] | None  # (clip, noise multiplier) when the client adds noise
    trainer: LocalTrain | None  # the task's own training loop; None: fedring's on partition()
    evaluator: LocalEvaluate | None  # the task's own evaluation; None: fedring's

    def build_model(self) -> torch.nn.Module:
        """A fresh model with the task's architecture."""
        ...

    def partition(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, labels) of one client's partition."""
        ...

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        """Change the delta a simulated attacker sends, in place (``seed``: any randomness);
        True when this client is one. Tasks without attacks return False."""
        ...


# Builds a task from the JSON-able task spec the server sends (or the run config gives).
TaskFactory = Callable[[Mapping[str, Any]], ClientTask]
# Resolves a task spec from a Flower run config when the server did not send one.
SpecResolver = Callable[[Mapping[str, Any]], Mapping[str, Any]]
