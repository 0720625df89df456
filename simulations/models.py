"""PyTorch models for simulations: ``mlp``, ``cnn``, ``logreg``, ``bn_mlp``, ``resnet``,
``char_lstm``.

``mlp``, ``cnn`` and ``logreg`` are plain ``nn.Sequential`` stacks of Linear/Conv2d/ReLU/
MaxPool/Flatten layers without dropout or batch norm: fully described by their parameters.
``bn_mlp`` and ``resnet`` have batch norm, whose running statistics are buffers that travel
with the parameters (``client.flat_model``). ``char_lstm`` takes int64 character indices.
All are float32 with initial weights that depend only on the torch seed, and return logits
(use ``nn.CrossEntropyLoss``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["build_model", "count_parameters", "model_names"]


def model_names() -> list[str]:
    """Kinds accepted by :func:`build_model`, sorted."""
    return sorted(_BUILDERS)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in ``model`` (all of them, trainable or not)."""
    return sum(p.numel() for p in model.parameters())


def build_model(
    kind: str, *, input_shape: tuple[int, ...], num_classes: int, **params: Any
) -> nn.Module:
    """Build a freshly initialised model; call ``torch.manual_seed`` first for fixed weights.

    - ``mlp``: flatten, then ``Linear + ReLU`` for each width in ``hidden`` (an int or a list of
      ints, default ``[64]``; ``[]`` gives logistic regression), then ``Linear`` to the classes.
    - ``cnn``: input ``(C, H, W)`` with H, W >= 2; ``Conv2d(3x3, padding 1) + ReLU`` for each
      width in ``channels`` (default ``[16, 32]``), ``MaxPool2d(2)``, flatten, ``Linear`` to the
      classes.
    - ``logreg``: flatten, one ``Linear`` to the classes (no params).
    - ``bn_mlp``: ``mlp`` with ``BatchNorm1d`` after each hidden ``Linear`` (``hidden``;
      ``cumulative = true``: batch norm's cumulative average, momentum None).
    - ``resnet``: input ``(C, H, W)`` with H, W >= 4; a CIFAR-style residual network: a
      ``Conv3x3 + BatchNorm + ReLU`` stem of ``width`` channels (default 32), then three
      stages of ``blocks`` basic residual blocks each (default 1; two ``Conv3x3 + BatchNorm``
      and a skip, 1x1 conv + BatchNorm where the shape changes) at ``width``, ``2 width`` and
      ``4 width`` channels, the last two halving H and W; global average pool, ``Linear``.
      At 3x32x32 and 10 classes the defaults give 0.31M parameters.
    - ``char_lstm``: LEAF's Shakespeare model: input ``(sequence length,)`` of int64
      indices below ``num_classes`` (the vocabulary; next-character prediction), then
      ``Embedding(num_classes, embedding_dim=8)``, an LSTM of ``layers`` (2) x ``hidden``
      (256), ``Linear`` from the last step's output to ``num_classes``.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown model {kind!r}; choose one of: {', '.join(model_names())}")
    builder, allowed = _BUILDERS[kind]
    unknown = sorted(set(params) - allowed)
    if unknown:
        accepted = ", ".join(sorted(allowed)) or "none"
        raise ValueError(
            f"unknown parameter {unknown[0]!r} for model {kind!r}; accepted: {accepted}"
        )
    shape = _check_shape(input_shape)
    if not _is_int(num_classes) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return builder(shape, int(num_classes), **params).to(torch.float32)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_shape(input_shape: Any) -> tuple[int, ...]:
    try:
        shape = tuple(input_shape)
    except TypeError:
        raise ValueError(
            f"input_shape must be a tuple of positive ints, got {input_shape!r}"
        ) from None
    if not shape or not all(_is_int(s) and s >= 1 for s in shape):
        raise ValueError(f"input_shape must be a tuple of positive ints, got {input_shape!r}")
    return tuple(int(s) for s in shape)


def _widths(name: str, value: Any, *, allow_empty: bool) -> list[int]:
    widths = [value] if _is_int(value) else value
    try:
        widths = list(widths)
    except TypeError:
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}") from None
    if not all(_is_int(w) and w >= 1 for w in widths):
        raise ValueError(f"{name} must hold positive ints, got {value!r}")
    if not widths and not allow_empty:
        raise ValueError(f"{name} needs at least one entry")
    return [int(w) for w in widths]


def _mlp(shape: tuple[int, ...], num_classes: int, *, hidden: Any = (64,)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(shape)
    for h in _widths("hidden", hidden, allow_empty=True):
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _cnn(shape: tuple[int, ...], num_classes: int, *, channels: Any = (16, 32)) -> nn.Module:
    if len(shape) != 3 or shape[1] < 2 or shape[2] < 2:
        raise ValueError(
            f"cnn needs input_shape (channels, height, width) with height, width >= 2, got {shape}"
        )
    c, h, w = shape
    layers: list[nn.Module] = []
    for out in _widths("channels", channels, allow_empty=False):
        layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
        c = out
    layers += [nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c * (h // 2) * (w // 2), num_classes)]
    return nn.Sequential(*layers)


def _bn_mlp(shape: tuple[int, ...], num_classes: int, *, hidden: Any = (64,),
            cumulative: bool = False) -> nn.Module:
    """Like ``mlp`` with ``BatchNorm1d`` after each hidden ``Linear``; ``cumulative`` keeps
    batch norm's cumulative average (momentum None, which counts batches)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(shape)
    for h in _widths("hidden", hidden, allow_empty=False):
        layers += [nn.Linear(width, h), nn.BatchNorm1d(h, momentum=None if cumulative else 0.1),
                   nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _logreg(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection (He et al. 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet(shape: tuple[int, ...], num_classes: int, *, width: Any = 32,
            blocks: Any = 1) -> nn.Module:
    if len(shape) != 3 or shape[1] < 4 or shape[2] < 4:
        raise ValueError(
            f"resnet needs input_shape (channels, height, width) with height, width >= 4, "
            f"got {shape}"
        )
    for name, value in (("width", width), ("blocks", blocks)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    w = int(width)
    layers: list[nn.Module] = [nn.Conv2d(shape[0], w, 3, padding=1, bias=False),
                               nn.BatchNorm2d(w), nn.ReLU()]
    c = w
    for stage, out in enumerate((w, 2 * w, 4 * w)):
        for i in range(int(blocks)):
            layers.append(_BasicBlock(c, out, stride=2 if stage > 0 and i == 0 else 1))
            c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


class CharLSTM(nn.Module):
    """Embedding, stacked LSTM, a linear layer on the last step (LEAF's Shakespeare model)."""

    def __init__(self, vocab: int, embedding_dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(x))
        return self.fc(out[:, -1])


def _char_lstm(shape: tuple[int, ...], num_classes: int, *, embedding_dim: Any = 8,
               hidden: Any = 256, layers: Any = 2) -> nn.Module:
    if len(shape) != 1:
        raise ValueError(f"char_lstm needs input_shape (sequence length,) of character "
                         f"indices, got {shape}")
    for name, value in (("embedding_dim", embedding_dim), ("hidden", hidden), ("layers", layers)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return CharLSTM(num_classes, int(embedding_dim), int(hidden), int(layers))


_BUILDERS: Mapping[str, tuple[Callable[..., nn.Module], frozenset[str]]] = {
    "bn_mlp": (_bn_mlp, frozenset({"hidden", "cumulative"})),
    "char_lstm": (_char_lstm, frozenset({"embedding_dim", "hidden", "layers"})),
    "cnn": (_cnn, frozenset({"channels"})),
    "logreg": (_logreg, frozenset()),
    "mlp": (_mlp, frozenset({"hidden"})),
    "resnet": (_resnet, frozenset({"width", "blocks"})),
}
