"""What a ClientApp needs to know about the learning task; supplied by the caller."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from client.training import TrainConfig

ATTACKER_METRIC = "attacker"  # reply metric: 1 when this client is a simulated attacker

# A task's own loops: (module, partition id, seed) -> (examples, metrics) for training on
# the partition, (module, partition id) -> (examples, metrics) for evaluation on the
# client's held-out split ((0, {}) when it has none).
LocalTrain = Callable[[torch.nn.Module, int, int], tuple[int, dict[str, float]]]
LocalEvaluate = Callable[[torch.nn.Module, int], tuple[int, dict[str, float]]]


class ClientTask(Protocol):
    """A model factory, the client's training data and held-out split, its settings."""

    train_config: TrainConfig
    seed: int
    local_dp: tuple[float, float] | None  # (clip, noise multiplier) when the client adds noise
    trainer: LocalTrain | None  # the task's own training loop; None: fedring's on partition()
    evaluator: LocalEvaluate | None  # the task's own evaluation; None: fedring's

    def build_model(self) -> torch.nn.Module:
        """A fresh model with the task's architecture."""
        ...

    def partition(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, labels) one client trains on: its partition less its held-out
        split."""
        ...

    def client_test(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (inputs, labels) of one client's held-out split, never trained on: what
        federated evaluation measures. None when the task holds none out."""
        ...

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        """Change the delta a simulated attacker sends, in place (``seed``: any randomness);
        True when this client is one. Tasks without attacks return False."""
        ...


# Builds a task from the JSON-able task spec the server sends (or the run config gives).
TaskFactory = Callable[[Mapping[str, Any]], ClientTask]
# Resolves a task spec from a Flower run config when the server did not send one.
SpecResolver = Callable[[Mapping[str, Any]], Mapping[str, Any]]
