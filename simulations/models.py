"""Small PyTorch models for simulations: ``mlp``, ``cnn``, ``logreg``, ``bn_mlp``.

Every model is a plain ``nn.Sequential`` of Linear/Conv2d/ReLU/MaxPool/Flatten layers on CPU in
float32, no dropout, and its initial weights depend only on the torch seed. ``bn_mlp`` adds
batch norm, whose running statistics travel with the parameters (``client.flat_model``).
Models return logits (use ``nn.CrossEntropyLoss``).
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


_BUILDERS: Mapping[str, tuple[Callable[..., nn.Module], frozenset[str]]] = {
    "bn_mlp": (_bn_mlp, frozenset({"hidden", "cumulative"})),
    "cnn": (_cnn, frozenset({"channels"})),
    "logreg": (_logreg, frozenset()),
    "mlp": (_mlp, frozenset({"hidden"})),
}
