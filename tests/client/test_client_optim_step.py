"""``client.optim_step``: torch's SGD and Adam stepped without their per-call wrappers
give bit for bit what ``opt.step()`` / ``opt.zero_grad(set_to_none=True)`` give."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from client import optim_step
from client.training import TrainConfig, make_optimizer, train

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd momentum dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                         dampening=0.1),
    "sgd nesterov weight decay": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                            nesterov=True, weight_decay=1e-2),
    "sgd maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam amsgrad weight decay": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True,
                                                             weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1,
                                         decoupled_weight_decay=True),
    "two groups": lambda ps: torch.optim.SGD([{"params": ps[:2]},
                                              {"params": ps[2:], "lr": 0.2, "momentum": 0.5}],
                                             lr=0.05),
}


class WithUnused(torch.nn.Module):
    """An MLP with a layer that forward never uses: its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _trained(make, fast: bool, steps: int = 6):
    torch.manual_seed(0)
    model = WithUnused()
    opt = make(list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(9, 6, generator=gen)
        y = torch.randint(0, 3, (9,), generator=gen)
        if fast:
            optim_step.zero_grad(opt)
        else:
            opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if fast:
            optim_step.step(opt)
        else:
            opt.step()
    return model, opt


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert state.keys() == sb["state"][key].keys()
        for name, value in state.items():
            other = sb["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), (key, name)
            else:
                assert value == other, (key, name)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_unwrapped_steps_equal_torchs_bit_for_bit(name):
    reference, ref_opt = _trained(OPTIMIZERS[name], fast=False)
    model, opt = _trained(OPTIMIZERS[name], fast=True)
    assert optim_step._unwrappable(opt)
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(model.unused.weight, reference.unused.weight)  # never stepped
    _same_state(ref_opt, opt)
    assert not any(p in opt.state and opt.state[p] for p in model.unused.parameters())
    assert all(p.grad is not None for p in model.body.parameters())
    optim_step.zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_with_a_hook_or_of_another_kind_takes_its_own_step():
    model = torch.nn.Linear(4, 2)
    calls = []
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.register_step_post_hook(lambda opt, args, kwargs: calls.append("sgd"))
    rms = torch.optim.RMSprop(model.parameters(), lr=0.1)
    rms.register_step_pre_hook(lambda opt, args, kwargs: calls.append("rmsprop"))
    for opt in (sgd, rms):
        assert not optim_step._unwrappable(opt)
        model(torch.ones(3, 4)).sum().backward()
        optim_step.step(opt)
        optim_step.zero_grad(opt)
        assert all(p.grad is None for p in model.parameters())
    assert calls == ["sgd", "rmsprop"]
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert not optim_step._unwrappable(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        handle.remove()


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)])
def test_local_training_equals_a_loop_of_torch_steps(optimizer, momentum):
    """``train`` (which steps through ``optim_step``) on a reused optimizer equals a
    plain loop of ``opt.step()`` on a fresh one: same batches, same result, every bit."""
    cfg = TrainConfig(lr=0.05, batch_size=4, local_epochs=2, optimizer=optimizer,
                      momentum=momentum)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    start = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(list(model.parameters()), cfg)
    train(model, x, y, cfg, seed=11, optimizer=opt)  # state left behind is reset next call
    with torch.no_grad():
        for p, s in zip(model.parameters(), start, strict=True):
            p.copy_(s)
    train(model, x, y, cfg, seed=11, optimizer=opt)

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))
    ref_opt = make_optimizer(list(reference.parameters()), cfg)
    order_gen = torch.Generator().manual_seed(11)
    for _ in range(cfg.local_epochs):
        order = torch.randperm(len(x), generator=order_gen)
        for start_at in range(0, len(x), cfg.batch_size):
            idx = order[start_at:start_at + cfg.batch_size]
            ref_opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(reference(x[idx]), y[idx]).backward()
            ref_opt.step()
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
