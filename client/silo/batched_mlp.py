"""Every learner's loss and gradient of a plain MLP at once, written out by hand.

For an ``nn.Sequential`` of ``Linear``, ``Flatten`` and element-wise activations, the
learners' forward is a chain of batched matrix products over their stacked weights and
the backward is its transpose, written here: no autograd graph, no per-step allocation
of parameter views. The parameters and the gradients are rows of two flat [L, D]
buffers (one row per learner, in ``named_parameters`` order); the views into them are
made once per round (``bind``). The loss is the mean cross-entropy of each learner's
batch (per-example weights: 1 / the batch's size, 0 for padding), summed over learners.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Identity)


@dataclass
class _Linear:
    name: str
    out_features: int
    in_features: int
    bias: bool


@dataclass
class _Act:
    kind: type


@dataclass
class _Flatten:
    pass


Layer = _Linear | _Act | _Flatten


def _layers(module: torch.nn.Module) -> list[Layer] | None:
    """The layers of a plain MLP, or None for any other model."""
    if not isinstance(module, torch.nn.Sequential) or len(module) == 0:
        return None
    if not all(p.requires_grad for p in module.parameters()):
        return None
    layers: list[Layer] = []
    for name, m in module.named_children():
        if isinstance(m, torch.nn.Linear):
            layers.append(_Linear(name, m.out_features, m.in_features, m.bias is not None))
        elif isinstance(m, ACTIVATIONS):
            layers.append(_Act(type(m)))
        elif isinstance(m, torch.nn.Flatten) and (m.start_dim, m.end_dim) == (1, -1):
            layers.append(_Flatten())
        else:
            return None
    if not any(isinstance(layer, _Linear) for layer in layers):
        return None
    return layers


class BatchedMLP:
    """Loss and gradients of ``L`` learners of one plain MLP over flat [L, D] buffers."""

    def __init__(self, layers: list[Layer], names: list[str]) -> None:
        self.layers, self.names = layers, names
        self._views: list[tuple[torch.Tensor, ...] | None] = []

    @classmethod
    def of(cls, module: torch.nn.Module, names: list[str]) -> BatchedMLP | None:
        """The hand-written path for ``module`` (its trainable parameters ``names``, in
        order), or None when ``module`` is not a plain MLP."""
        layers = _layers(module)
        if layers is None or names != [n for n, _ in module.named_parameters()]:
            return None
        return cls(layers, names)

    def bind(self, w: torch.Tensor, g: torch.Tensor) -> None:
        """Read the learners' parameters from ``w`` [L, D], write gradients into ``g``."""
        count, offset = len(w), 0
        self._views = []
        for layer in self.layers:
            if not isinstance(layer, _Linear):
                self._views.append(None)
                continue
            size = layer.out_features * layer.in_features
            shape = (count, layer.out_features, layer.in_features)
            weight, grad_w = (t[:, offset:offset + size].view(shape) for t in (w, g))
            offset += size
            bias = grad_b = None
            if layer.bias:
                bias, grad_b = (t[:, offset:offset + layer.out_features] for t in (w, g))
                offset += layer.out_features
            self._views.append((weight, grad_w, bias, grad_b))
        if offset != w.shape[1]:
            raise ValueError(f"the model has {w.shape[1]} parameters, its layers {offset}")

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
                      ) -> torch.Tensor:
        """The weighted loss summed over learners (a 0-d tensor); the gradient of each
        learner's share goes into its row of the bound gradient buffer. ``x`` [L, B, ...],
        ``y`` [L, B] class indices, ``weight`` [L, B]."""
        h = x
        saved: list[torch.Tensor] = []  # each layer's input (activations: their output)
        shapes: list[torch.Size] = []
        for layer, views in zip(self.layers, self._views, strict=True):
            if isinstance(layer, _Flatten):
                shapes.append(h.shape)
                h = h.flatten(2)
            elif isinstance(layer, _Linear):
                saved.append(h)
                w, _, b, _ = views  # type: ignore[misc]
                h = (torch.bmm(h, w.transpose(1, 2)) if b is None
                     else torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2)))
            else:
                h = _forward(layer.kind, h)
                saved.append(h)
        logp = torch.log_softmax(h, dim=2)
        target = y.unsqueeze(2)
        loss = torch.mul(logp.gather(2, target).squeeze(2), weight).sum().neg_()
        d = logp.exp_()  # softmax - onehot, times each example's weight
        d.scatter_add_(2, target, torch.full_like(target, -1, dtype=d.dtype))
        d.mul_(weight.unsqueeze(2))
        first = next(i for i, layer in enumerate(self.layers) if isinstance(layer, _Linear))
        for i in range(len(self.layers) - 1, first - 1, -1):  # nothing to train before first
            layer = self.layers[i]
            if isinstance(layer, _Flatten):
                d = d.view(shapes.pop())
                continue
            inp = saved.pop()
            if isinstance(layer, _Act):
                d = _backward(layer.kind, inp, d)
                continue
            w, grad_w, _, grad_b = self._views[i]  # type: ignore[misc]
            grad_w.copy_(torch.bmm(d.transpose(1, 2), inp))  # (out= a strided view: slower)
            if grad_b is not None:
                torch.sum(d, dim=1, out=grad_b)
            if i > first:
                d = torch.bmm(d, w)
        return loss


def _forward(kind: type, a: torch.Tensor) -> torch.Tensor:
    if kind is torch.nn.ReLU:
        return torch.relu(a)
    if kind is torch.nn.Tanh:
        return torch.tanh(a)
    if kind is torch.nn.Sigmoid:
        return torch.sigmoid(a)
    return a


def _backward(kind: type, out: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The gradient before an activation, from its output ``out`` and the gradient after."""
    if kind is torch.nn.ReLU:  # ReLU's own backward: no mask tensor, no type conversion
        return torch.ops.aten.threshold_backward(d, out, 0.0)
    if kind is torch.nn.Tanh:
        return d.mul_(1 - out * out)
    if kind is torch.nn.Sigmoid:
        return d.mul_(out * (1 - out))
    return d
