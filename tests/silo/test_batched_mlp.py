"""The hand-written batched MLP against autograd through vmap of functional_call."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from client.silo.batched_mlp import BatchedMLP
from client.silo.learners import AutogradLearners

nn = torch.nn


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "relu": nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)),
        "flatten_tanh_no_bias": nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(),
                                              nn.Linear(16, 8, bias=False), nn.Sigmoid(),
                                              nn.Linear(8, 3)),
        "identity_one_layer": nn.Sequential(nn.Flatten(), nn.Identity(), nn.Linear(12, 3)),
    }


@pytest.mark.parametrize("name", sorted(models()))
def test_loss_and_gradients_equal_autograd(name: str) -> None:
    model = models()[name]
    names = [n for n, _ in model.named_parameters()]
    dim = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    w = 0.5 * torch.randn(3, dim, generator=gen)
    x = torch.randn(3, 5, 3, 4, generator=gen)
    x = x if name.startswith(("flatten", "identity")) else x.flatten(2)
    y = torch.randint(0, 3, (3, 5), generator=gen)
    weight = torch.rand(3, 5, generator=gen)
    weight[2, 3:] = 0  # padding
    mlp = BatchedMLP.of(model, names)
    assert mlp is not None
    grads = {}
    losses = {}
    for kind, learners in (("mlp", mlp), ("autograd", AutogradLearners(model, names))):
        grads[kind] = torch.full_like(w, float("nan"))
        learners.bind(w, grads[kind])
        losses[kind] = learners.loss_and_grad(x, y, weight)
    assert (grads["mlp"] - grads["autograd"]).abs().max() < 1e-6
    assert abs(float(losses["mlp"] - losses["autograd"])) < 1e-5
    views = _views(model, w)
    expected = sum((F.cross_entropy(torch.func.functional_call(
        model, {n: p[j] for n, p in views.items()}, (x[j],)), y[j], reduction="none")
        * weight[j]).sum() for j in range(3))
    assert abs(float(losses["mlp"] - expected)) < 1e-5


def _views(model: nn.Module, w: torch.Tensor) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n, p in model.named_parameters():
        out[n] = w[:, offset:offset + p.numel()].view(len(w), *p.shape)
        offset += p.numel()
    return out


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)),  # an activation it lacks
    nn.Sequential(nn.Conv1d(1, 1, 3)),  # not an MLP
    nn.Linear(4, 2),  # not a Sequential
])
def test_other_models_take_the_autograd_path(model: nn.Module) -> None:
    assert BatchedMLP.of(model, [n for n, _ in model.named_parameters()]) is None
