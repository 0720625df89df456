"""FedProx through the real ServerApp and ClientApp: the proximal term pulls local training
towards the model the round sent (Li et al. 2020), checked against a loop written here."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from client.app import training_seed
from client.flat_model import FlatModel
from simulations.config import load_scenario
from simulations.task import ScenarioTask

MU = 2.0


def _scenario(mu: float, clients: int) -> dict[str, Any]:
    return load_scenario("default", [f"federation.clients={clients}", "federation.rounds=2",
                                     "federation.min_clients=1", "train.local_epochs=1",
                                     f"train.proximal_mu={mu}"])


def _fedprox_delta(config: dict[str, Any], start: np.ndarray, anchor: np.ndarray,
                   rnd: int, pid: int) -> np.ndarray:
    """Local training from ``start`` with loss CE + (mu/2)||w - anchor||^2, written out here:
    the client's batch order and optimizer, the FedProx term from the paper."""
    task = ScenarioTask.from_config(config)
    cfg = task.train_config
    assert cfg.optimizer == "sgd" and cfg.proximal_mu > 0
    model = FlatModel(task.build_model())
    model.load(start)
    params = list(model.module.parameters())
    anchor_model = FlatModel(task.build_model())
    anchor_model.load(anchor)
    anchors = [p.detach().clone() for p in anchor_model.module.parameters()]
    x, y = task.partition(pid)
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    gen = torch.Generator().manual_seed(training_seed(task.seed, rnd, pid))
    model.module.train()
    for _ in range(cfg.local_epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            opt.zero_grad()
            prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchors, strict=True))
            loss = F.cross_entropy(model.module(x[idx]), y[idx]) + cfg.proximal_mu / 2 * prox
            loss.backward()
            opt.step()
    return model.vector() - start


def test_fedprox_anchors_at_the_round_s_global_model(run_inprocess) -> None:
    """One client, two rounds: round 2 starts from round 1's model, which differs from the
    initial one, and its delta is FedProx anchored there (not at the live weights, which
    would make the term vanish, nor at the initial model)."""
    config = _scenario(MU, clients=1)
    models: list[np.ndarray] = []
    summary = run_inprocess(config, models=models)
    assert summary["versions"] == 2 and len(models) == 3
    initial, after_one, after_two = models
    assert np.abs(after_one - initial).max() > 1e-2  # round 2's anchor is not the initial model
    got = after_two - after_one  # FedAvg, one client, server_lr 1: the client's delta
    expected = _fedprox_delta(config, after_one, after_one, rnd=2, pid=0)
    np.testing.assert_allclose(got, expected, atol=2e-6)
    # the anchor matters: anchored at the initial model, or plain training, differ
    assert np.abs(_fedprox_delta(config, after_one, initial, rnd=2, pid=0) - got).max() > 1e-3


def test_fedprox_changes_training_through_the_clientapp(run_inprocess) -> None:
    runs = {}
    for mu in (0.0, MU):
        models: list[np.ndarray] = []
        run_inprocess(_scenario(mu, clients=3), models=models)
        runs[mu] = models
    assert np.array_equal(runs[0.0][0], runs[MU][0])  # same start
    moved = {mu: np.linalg.norm(m[-1] - m[0]) for mu, m in runs.items()}
    assert np.abs(runs[MU][-1] - runs[0.0][-1]).max() > 1e-2
    assert moved[MU] < moved[0.0]  # the proximal term holds each round near its start
