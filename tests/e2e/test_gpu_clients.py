"""Clients that train on CUDA (``train.device``): the same model as on the CPU, within the
tolerance of GPU kernels, on the in-process engine and on Flower's Ray engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from client.flat_model import FlatModel
from client.training import TrainConfig, train, train_dp_sgd
from simulations.config import load_scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8),
                         nn.Linear(8, 3))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 2, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _config(*extra: str) -> dict[str, Any]:
    return load_scenario("default", ["federation.clients=3", "federation.rounds=1",
                                     "federation.min_clients=1", "train.local_epochs=1",
                                     "model.kind=bn_mlp", "model.hidden=[16]", *extra])


def test_the_flat_vector_lives_on_the_gpu_and_crosses_once_each_way() -> None:
    model = FlatModel(_bn_model(), "cuda")
    assert model.flat.is_cuda and not model.on_host
    assert all(p.is_cuda for p in model.module.parameters())
    assert all(b.is_cuda for b in model.module.buffers())
    start = np.linspace(-1, 1, model.dim, dtype=np.float32)
    model.load(start)
    np.testing.assert_array_equal(model.flat.cpu().numpy(), start)
    x, y = (t.cuda() for t in _data())
    train(model.module, x, y, TrainConfig(batch_size=16), seed=0)
    assert np.array_equal(model.flat_np, start)  # the mirror waits for to_host
    after = model.vector()
    assert np.abs(after - start).max() > 1e-3
    sd = model.module.state_dict()
    for name, view in model.layout.unflatten(after).items():
        np.testing.assert_array_equal(view, sd[name].cpu().numpy())
    assert int(model.exact["1.num_batches_tracked"]) == 4


def test_training_on_cuda_gives_the_cpu_delta_within_tolerance() -> None:
    x, y = _data()
    cfg = TrainConfig(batch_size=16, momentum=0.9, proximal_mu=0.1)
    results = {}
    for device in ("cpu", "cuda"):
        model = FlatModel(_bn_model(), device)
        start = model.vector().copy()
        anchor = [p.detach().clone() for p in model.module.parameters()]
        train(model.module, x.to(device), y.to(device), cfg, seed=5, global_params=anchor)
        results[device] = (model.vector() - start, {n: int(t) for n, t in model.exact.items()})
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], atol=1e-4)
    assert np.abs(results["cpu"][0]).max() > 1e-2
    assert results["cuda"][1] == results["cpu"][1]


def test_dp_sgd_runs_on_cuda_with_the_same_accounting() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(72, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = _data()
    cfg = TrainConfig(batch_size=16, dp_sgd_noise_multiplier=1.0)
    model = FlatModel(module, "cuda")
    start = model.vector().copy()
    _, eps_cuda = train_dp_sgd(model.module, x.cuda(), y.cuda(), cfg)
    assert np.abs(model.vector() - start).max() > 0
    _, eps_cpu = train_dp_sgd(FlatModel(module.cpu()).module, x, y, cfg)
    assert eps_cuda == pytest.approx(eps_cpu)


def test_an_inprocess_run_on_cuda_gives_the_cpu_model(run_inprocess) -> None:
    runs = {}
    for device in ("cpu", "cuda"):
        models: list[np.ndarray] = []
        run_inprocess(_config(f"train.device={device}", "aggregation.local_buffers=true"),
                      models=models)
        runs[device] = models
    np.testing.assert_array_equal(runs["cuda"][0], runs["cpu"][0])
    np.testing.assert_allclose(runs["cuda"][1], runs["cpu"][1], atol=1e-4)
    assert np.abs(runs["cpu"][1] - runs["cpu"][0]).max() > 1e-2


@pytest.mark.slow
def test_flower_s_ray_engine_gives_each_client_a_gpu_share(db_url) -> None:
    """Ray hides the GPU from clients that ask for none; "cuda" would then be refused by
    every client and no round applied."""
    from simulations.cli import run_simulation

    summary = run_simulation(_config("train.device=cuda"), engine="flower", db=db_url)
    assert summary["status"] == "completed" and summary["versions"] == 1
