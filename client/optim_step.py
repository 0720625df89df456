"""``opt.step()`` and ``opt.zero_grad(set_to_none=True)`` without torch's per-call wrappers.

``Optimizer.step`` runs inside a wrapper (step hooks, a profiler range, grad-mode and
compiler guards) and ``zero_grad`` inside another: about 30 µs a step on a small CPU,
three times the arithmetic of a step of a 10k-parameter model. A federated client
of a small model takes one or a few steps a round, so those wrappers were a sixth of
its training. For torch's own SGD and Adam, with no hooks registered, :func:`step`
runs what their ``step()`` runs inside the wrapper: the optimizer's ``_init_group``
(its state, made as torch makes it) and the functional ``sgd`` / ``adam`` with the
group's settings, under ``no_grad``. The result is bit for bit that of ``opt.step()``.
Any other optimizer, or one with hooks, takes ``opt.step()`` itself.
"""

from __future__ import annotations

import torch
from torch.optim import SGD, Adam
from torch.optim import optimizer as _optimizer
from torch.optim.adam import adam
from torch.optim.sgd import sgd


def _sgd_group(opt: SGD, group: dict) -> None:
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    buffers: list[torch.Tensor | None] = []
    sparse = opt._init_group(group, params, grads, buffers)
    sgd(params, grads, buffers, weight_decay=group["weight_decay"],
        momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
        nesterov=group["nesterov"], maximize=group["maximize"], has_sparse_grad=sparse,
        foreach=group["foreach"], fused=group["fused"])
    if group["momentum"] != 0:
        for p, buf in zip(params, buffers, strict=True):
            opt.state[p]["momentum_buffer"] = buf


def _adam_group(opt: Adam, group: dict) -> None:
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    has_complex = opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs,
                                  max_exp_avg_sqs, steps)
    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
         amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
         maximize=group["maximize"], foreach=group["foreach"],
         capturable=group["capturable"], differentiable=group["differentiable"],
         fused=group["fused"], decoupled_weight_decay=group["decoupled_weight_decay"])


_GROUP_STEPS = {SGD: _sgd_group, Adam: _adam_group}


def _unwrappable(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is torch's own SGD or Adam with nothing its wrappers would run:
    no step hooks (its own or global), not differentiable, no gradient scaling."""
    return (type(opt) in _GROUP_STEPS and not opt.defaults.get("differentiable")
            and not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
            and not _optimizer._global_optimizer_pre_hooks
            and not _optimizer._global_optimizer_post_hooks
            and getattr(opt, "grad_scale", None) is None
            and getattr(opt, "found_inf", None) is None)


def step(opt: torch.optim.Optimizer) -> None:
    """What ``opt.step()`` does (see the module's docstring)."""
    if not _unwrappable(opt):
        opt.step()
        return
    group_step = _GROUP_STEPS[type(opt)]
    with torch.no_grad():
        for group in opt.param_groups:
            group_step(opt, group)


def zero_grad(opt: torch.optim.Optimizer) -> None:
    """What ``opt.zero_grad(set_to_none=True)`` does."""
    if not _unwrappable(opt):
        opt.zero_grad(set_to_none=True)
        return
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
