"""SMA written as a plain loop, one model per learner, for the learner tests to compare with.

Crossbow's rule (Algorithm 1): every step each learner j takes c_j = alpha * (w_j - z)
at its weights before the step, w_j <- w_j - lr * grad_j - c_j (SGD with torch's
momentum and weight decay on grad_j), and z <- z + sum_j(c_j) + mu * (z - z_prev).
Learner j of ``total`` takes batch s * total + j of the round's batches at step s (none
left: no gradient step). ``carry``: the learners across rounds (their offsets from z,
momentum buffers and z - z_prev), read when it holds them and written at the end.
"""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def reference_sma(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int,
                  batch_size: int, lr: float, momentum: float, weight_decay: float,
                  alpha: float, mu: float, seed: int, total: int, carry: dict | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's (learners [total, D], z [D]), from ``model``'s parameters."""
    carry = {} if carry is None else carry
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        batches += [order[i:i + batch_size] for i in range(0, len(x), batch_size)]
    learners = [copy.deepcopy(model) for _ in range(total)]
    bufs: list[torch.Tensor | None] = carry.get("bufs", [None] * total)
    z = parameters_to_vector(model.parameters()).detach().clone()
    z_prev = z - carry.get("drift", torch.zeros_like(z))
    for j, learner in enumerate(learners):
        if "offsets" in carry:
            vector_to_parameters(z + carry["offsets"][j], learner.parameters())
    out = []
    for s in range((len(batches) + total - 1) // total):
        corrections = []
        for j, learner in enumerate(learners):
            w = parameters_to_vector(learner.parameters()).detach()
            c = alpha * (w - z)
            corrections.append(c)
            k = s * total + j
            step = torch.zeros_like(w)
            if k < len(batches):
                learner.zero_grad()
                idx = batches[k]
                F.cross_entropy(learner(x[idx]), y[idx]).backward()
                g = torch.cat([p.grad.reshape(-1) for p in learner.parameters()])
                g = g + weight_decay * w
                if momentum:
                    bufs[j] = g if bufs[j] is None else momentum * bufs[j] + g
                    g = bufs[j]
                step = lr * g
            vector_to_parameters(w - step - c, learner.parameters())
        z, z_prev = z + torch.stack(corrections).sum(0) + mu * (z - z_prev), z
        out.append((torch.stack([parameters_to_vector(m.parameters()).detach()
                                 for m in learners]), z.clone()))
    carry["offsets"] = torch.stack([parameters_to_vector(m.parameters()).detach() - z
                                    for m in learners])
    carry["bufs"], carry["drift"] = bufs, z - z_prev
    return out
