"""A task module as a new user writes one: a small CNN with batch norm on scikit-learn's
8x8 digits, pixels as they come (0 to 16, not normalised), so the running means and
variances move by several units in a round, well beyond a per-coordinate range of 1."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset

TEST = 360


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = torch.tensor(data.images[order], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(data.target[order], dtype=torch.int64)


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 10))


def load_partition(partition_id: int, num_partitions: int) -> Dataset:
    x, y = _digits()
    part = np.array_split(np.arange(TEST, len(y)), num_partitions)[partition_id]
    return TensorDataset(x[part], y[part])


def load_test() -> Dataset:
    x, y = _digits()
    return TensorDataset(x[:TEST], y[:TEST])
