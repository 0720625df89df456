"""Sample-level DP inside local training (Opacus DP-SGD)."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from flwr.app import RecordDict

from client.dp_sgd import DPSGDBudgetExceeded, dp_sgd_round
from client.flat_model import FlatModel
from client.training import TrainConfig, dp_sgd_round_steps, train, train_dp_sgd
from simulations.config import load_scenario


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


# ---- composed over a client's rounds, in its node state

def _rounds_epsilon(n: int, batch: int, epochs: int, rounds: int, z: float,
                    delta: float) -> float:
    """dp_accounting over ``rounds`` rounds of DP-SGD: each round is epochs * n / batch
    steps of the Gaussian at z sampled with probability q = batch / n per example
    (add/remove one example moves the clipped sum by C)."""
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dp_accounting.PoissonSampledDpEvent(batch / n, dp_accounting.GaussianDpEvent(z))
    acc.compose(event, rounds * epochs * round(n / batch))
    return acc.get_epsilon(delta)


def test_node_state_composes_the_clients_rounds():
    x, y = _data(80)
    cfg = TrainConfig(local_epochs=2, batch_size=20, dp_sgd_noise_multiplier=1.1)
    state, model = RecordDict(), _model()
    for k in (1, 2, 3):
        _, figures = dp_sgd_round(model.module, x, y, cfg, state)
        assert figures["dp_sgd_rounds"] == k and figures["dp_sgd_round_steps"] == 2 * 4
        assert figures["dp_sgd_epsilon"] == pytest.approx(
            _rounds_epsilon(80, 20, 2, k, 1.1, 1e-5), rel=1e-9)
        assert figures["dp_sgd_epsilon_next"] == pytest.approx(
            _rounds_epsilon(80, 20, 2, k + 1, 1.1, 1e-5), rel=1e-9)
    _, fresh = dp_sgd_round(model.module, x, y, cfg, RecordDict())  # another node: its own
    assert fresh["dp_sgd_rounds"] == 1


def test_prior_rounds_can_raise_a_clients_history_never_lower_it():
    x, y = _data(80)
    cfg = TrainConfig(batch_size=20, dp_sgd_noise_multiplier=1.1)
    model = _model()
    _, forgot = dp_sgd_round(model.module, x, y, cfg, RecordDict(), prior_rounds=2)
    assert forgot["dp_sgd_rounds"] == 3  # a node that lost its state composes the 2 it forgot
    assert forgot["dp_sgd_epsilon"] == pytest.approx(_rounds_epsilon(80, 20, 1, 3, 1.1, 1e-5),
                                                     rel=1e-9)
    state = RecordDict()
    for _ in range(3):
        dp_sgd_round(model.module, x, y, cfg, state)
    _, kept = dp_sgd_round(model.module, x, y, cfg, state, prior_rounds=1)
    assert kept["dp_sgd_rounds"] == 4  # its own history is longer: the server cannot lower it


def test_a_round_past_the_budget_is_refused_before_training_and_not_charged():
    x, y = _data(80)
    one = _rounds_epsilon(80, 20, 1, 1, 1.1, 1e-5)
    two = _rounds_epsilon(80, 20, 1, 2, 1.1, 1e-5)
    cfg = TrainConfig(batch_size=20, dp_sgd_noise_multiplier=1.1,
                      dp_sgd_epsilon_budget=(one + two) / 2)
    state, model = RecordDict(), _model()
    dp_sgd_round(model.module, x, y, cfg, state)
    before = model.vector().copy()
    with pytest.raises(DPSGDBudgetExceeded, match=r"train\.dp_sgd_epsilon_budget"):
        dp_sgd_round(model.module, x, y, cfg, state)
    assert (model.vector() == before).all()  # not trained
    with pytest.raises(DPSGDBudgetExceeded) as refused:
        dp_sgd_round(model.module, x, y, cfg, state)  # still one round spent, still refused
    assert "over 1 rounds" in str(refused.value)


def test_every_step_is_taken_also_on_an_empty_batch(monkeypatch):
    """Each step is one Poisson-sampled Gaussian: an empty draw still adds noise, so the
    steps accounted are the steps taken."""
    from opacus.optimizers import DPOptimizer
    taken = []
    step = DPOptimizer.step
    monkeypatch.setattr(DPOptimizer, "step", lambda self, *a, **k: (taken.append(1),
                                                                    step(self, *a, **k))[1])
    x, y = _data(64)
    cfg = TrainConfig(batch_size=1, dp_sgd_noise_multiplier=1.0)  # q = 1/64: ~37% empty
    model = _model()
    train_dp_sgd(model.module, x, y, cfg)
    assert len(taken) == dp_sgd_round_steps(64, cfg) == 64


def test_dp_sgd_budget_is_checked_at_start_naming_the_key():
    with pytest.raises(ValueError, match=r"train\.dp_sgd_noise_multiplier > 0"):
        TrainConfig(dp_sgd_epsilon_budget=1.0)
    for bad in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match=r"train\.dp_sgd_epsilon_budget must be"):
            TrainConfig(dp_sgd_noise_multiplier=1.0, dp_sgd_epsilon_budget=bad)
    with pytest.raises(ValueError, match=r"train\.dp_sgd_epsilon_budget"):
        load_scenario("default", ["train.dp_sgd_epsilon_budget=3.0"])
    cfg = load_scenario("default", ["train.dp_sgd_noise_multiplier=1.0",
                                    "train.dp_sgd_epsilon_budget=3"])
    assert cfg["train"]["dp_sgd_epsilon_budget"] == 3.0
    with pytest.raises(ValueError, match="under secure aggregation the server sees no"):
        load_scenario("default", ["train.dp_sgd_noise_multiplier=1.0", "secagg.enabled=true",
                                  'aggregation.weight_by="uniform"',
                                  "train.dp_sgd_epsilon_budget=3"])
