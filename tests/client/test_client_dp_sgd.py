"""Sample-level DP inside local training (Opacus DP-SGD)."""

from __future__ import annotations

import dp_accounting
import pytest
import torch

from client.flat_model import FlatModel
from client.training import TrainConfig, train, train_dp_sgd


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 3)))


def test_per_sample_clipping_bounds_every_step():
    x, y = _data()
    cfg = TrainConfig(local_epochs=1, batch_size=16, lr=1.0, dp_sgd_noise_multiplier=1e-9,
                      dp_sgd_max_grad_norm=1e-3)
    model = _model()
    before = model.vector().copy()
    train_dp_sgd(model.module, x, y, cfg)
    steps = 4  # epochs * round(n / batch_size)
    # each step moves by lr * (sum of clipped per-sample grads) / batch <= lr * C (+ noise ~ 0)
    moved = float(torch.linalg.vector_norm(torch.from_numpy(model.vector() - before)))
    assert 0 < moved <= steps * 1.0 * 1e-3 * 1.5


def test_module_is_plain_again_and_trains_without_dp_after():
    x, y = _data()
    model = _model()
    cfg = TrainConfig(local_epochs=1, batch_size=16, dp_sgd_noise_multiplier=1.0)
    train_dp_sgd(model.module, x, y, cfg)
    train_dp_sgd(model.module, x, y, cfg)  # wrapping twice must not stack hooks
    for sub in model.module.modules():
        assert not sub._forward_hooks and not sub._backward_hooks
        assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None
                       for p in sub.parameters(recurse=False))
    before = model.vector().copy()
    train(model.module, x, y, TrainConfig(local_epochs=1, batch_size=16), seed=4)
    assert (model.vector() != before).any()  # params still live in the flat buffer


def test_reported_epsilon_matches_dp_accounting():
    x, y = _data(80)
    cfg = TrainConfig(local_epochs=2, batch_size=20, dp_sgd_noise_multiplier=1.1,
                      dp_sgd_delta=1e-5)
    _, eps = train_dp_sgd(_model().module, x, y, cfg)
    q, steps = 20 / 80, 2 * 4
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), steps)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=0.05)


def test_noise_and_batches_are_not_replayable_from_the_global_seed():
    """Two calls from the same model, data and torch seed still draw different noise and
    batches: nothing of DP-SGD's randomness comes from a seed the server knows."""
    x, y = _data()
    cfg = TrainConfig(local_epochs=1, batch_size=16, dp_sgd_noise_multiplier=1.0)
    results = []
    for _ in range(2):
        model = _model()  # seeds torch's global generator as the run seed would
        train_dp_sgd(model.module, x, y, cfg)
        results.append(model.vector().copy())
    assert (results[0] != results[1]).mean() > 0.9


def test_bad_dp_sgd_settings_fail_with_a_message():
    with pytest.raises(ValueError, match="dp_sgd_max_grad_norm"):
        TrainConfig(dp_sgd_noise_multiplier=1.0, dp_sgd_max_grad_norm=0.0)
    with pytest.raises(ValueError, match="proximal_mu = 0"):
        TrainConfig(dp_sgd_noise_multiplier=1.0, proximal_mu=0.1)
