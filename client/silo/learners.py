"""Several learners per silo process, synchronised by synchronous model averaging (SMA).

Crossbow (Koliousis et al., VLDB 2019, section 3, Algorithm 1) keeps small batches
efficient by training ``L`` independent replicas ("learners") per device and pulling
them together through a central average model ``z``. fedring runs it inside a silo of
``P`` processes, each training its ``L`` learners as ONE batched computation over one
flat [L, D] buffer of their parameters: a plain ``nn.Sequential`` MLP through batched
matrix products with the backward written out (``client.silo.batched_mlp``), any other
model through ``torch.func.vmap`` of ``functional_call`` and one autograd backward
(``AutogradLearners``). Every step, for each of the ``P * L`` learners ``j`` (weights
``w_j``, gradient ``g_j`` of its own batch's mean loss at ``w_j``), as the paper's
Algorithm 1:

    c_j   = alpha * (w_j - z)                        the correction, at the pre-step w_j
    w_j  <- w_j - lr * g_j - c_j                     (SGD; train.momentum and
                                                      train.weight_decay act on g_j)
    z    <- z + sum_j(c_j) + mu * (z - z_prev)       the sum over all P * L learners

with ``alpha`` = ``silo.sma_correction`` and ``mu`` = ``silo.sma_momentum``. The
corrections are summed over the silo's processes with one ``dist.all_reduce`` of the
silo's group per step (the group DDP uses). Without momentum ``z`` moves
``alpha * P * L`` of the way to the learners' mean, so ``alpha * P * L <= 1``
(``LearnerSpec`` checks ``alpha * L`` at start, ``check_correction`` the silo's
processes too); ``alpha = 1 / (P * L)`` moves it to the mean. The paper's sum, rather
than the mean of the corrections, took fewer epochs to the benchmark's target
(``benchmarks/crossbow.py``): learners pulled a quarter of the way while ``z`` steps to
their mean.

Learners persist across silo rounds (``LearnerState``, kept by the caller per silo
process): a round starts each learner at the round's model plus its offset from ``z``
at the last round's end, and carries on the learners' SGD momentum and ``z``'s last
step. When the round's model is the silo's own ``z`` (one silo, a FedAvg step of 1),
that is the learners as they were; with other silos, each learner keeps its place
relative to the new consensus. Without a state (or with another ``L`` or model) every
learner starts at the round's model, with no momentum.

Batches: every process draws the round's batch order as ``client.training.train`` does
(a seeded ``randperm`` per epoch, batches of ``train.batch_size``); all epochs' batches,
in order, are dealt ``P * L`` per step: learner ``j`` of rank ``r`` (global index
``r * L + j``) takes batch ``s * P * L + r * L + j`` at step ``s``. A learner without a
batch in the last step takes no gradient step but is still corrected. The silo's update
is its average model's delta, ``z_end - start``: ``z_end`` is written into the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.func import functional_call, vmap
from torch.nn import functional as F

from client.protocol.learners import LearnerSpec
from client.silo.batched_mlp import BatchedMLP
from client.training import TrainConfig

# on_step(step, learners [L, D], z [D]) after every step (tests compare the trajectory)
StepHook = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class LearnerState:
    """What a silo process's learners carry from one round to the next: each learner's
    offset from the average model (``w_j - z``, [L, D]), the average model's last step
    (``z - z_prev``, [D]) and the learners' SGD momentum ([L, D], None without)."""

    offsets: torch.Tensor | None = None
    drift: torch.Tensor | None = None
    momentum: torch.Tensor | None = None

    def fits(self, learners: int, dim: int) -> bool:
        """Whether it holds ``learners`` learners of a ``dim``-parameter model."""
        return self.offsets is not None and tuple(self.offsets.shape) == (learners, dim)

    def keep(self, offsets: torch.Tensor, drift: torch.Tensor,
             momentum: torch.Tensor | None) -> None:
        self.offsets, self.drift, self.momentum = offsets, drift, momentum


def check_learners(module: torch.nn.Module, cfg: TrainConfig) -> None:
    """Settings learners with SMA cannot honour (a clear error naming the key)."""
    reason = LearnerSpec(2).refusal({"dp_sgd_noise_multiplier": cfg.dp_sgd_noise_multiplier,
                                     "proximal_mu": cfg.proximal_mu,
                                     "optimizer": cfg.optimizer})
    if reason is not None:
        raise ValueError(reason)
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        raise ValueError(f"silo.learners > 1 cannot average buffers ({', '.join(buffers[:3])}:"
                         " batch statistics): use a model without batch norm or "
                         "silo.learners = 1")


def check_correction(spec: LearnerSpec, processes: int) -> None:
    """The sum of ``processes * L`` corrections must not overshoot the learners' mean."""
    total = spec.learners * processes
    if spec.correction is not None and spec.correction * total > 1:
        raise ValueError(f"silo.sma_correction = {spec.correction:g} with {total} learners "
                         f"in the silo ({processes} processes x {spec.learners}): the average "
                         "model would overshoot the learners' mean; set silo.sma_correction "
                         f"<= {1 / total:.4g}, or to \"auto\" (1 / the silo's learners)")


def batch_plan(n: int, cfg: TrainConfig, seed: int, total: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index [S, total, B], weight [S, total, B], has [S, total]): the round's batch
    order, as ``client.training.train`` draws it (a seeded ``randperm`` per epoch, batches
    of ``B`` = ``train.batch_size``), dealt ``total`` a step; padding takes example 0 and
    weighs 0, a real example 1 / its batch's size (a mean); ``has``: the learner has a
    batch at that step."""
    gen = torch.Generator().manual_seed(seed)
    b = min(cfg.batch_size, max(n, 1))
    per_epoch = -(-n // b)  # batches an epoch
    index = torch.zeros(cfg.local_epochs, per_epoch * b, dtype=torch.long)
    for e in range(cfg.local_epochs):
        index[e, :n] = torch.randperm(n, generator=gen)
    real = (torch.arange(per_epoch * b) < n).expand(cfg.local_epochs, -1).reshape(-1, b)
    steps = -(-len(real) // total)
    pad = steps * total - len(real)
    index = torch.cat([index.reshape(-1, b), torch.zeros(pad, b, dtype=torch.long)])
    real = torch.cat([real, torch.zeros(pad, b, dtype=torch.bool)]).float()
    weight = real / real.sum(1, keepdim=True).clamp(min=1)
    shape = (steps, total, b)
    return (index.view(shape).to(device), weight.view(shape).to(device),
            (real.sum(1) > 0).view(steps, total).to(device))


class AutogradLearners:
    """Loss and gradients of ``L`` learners of any model: ``vmap`` of ``functional_call``
    over the stacked parameters, then one backward (each learner's loss depends only on
    its own row)."""

    def __init__(self, module: torch.nn.Module, names: list[str]) -> None:
        params = dict(module.named_parameters())
        self.names = names
        self.shapes = [params[n].shape for n in names]
        self.sizes = [params[n].numel() for n in names]
        self.forward = vmap(lambda p, xb: functional_call(module, p, (xb,)))
        self.w = self.g = torch.zeros(0)

    def bind(self, w: torch.Tensor, g: torch.Tensor) -> None:
        """Read the learners' parameters from ``w`` [L, D], write gradients into ``g``."""
        self.w, self.g = w, g

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
                      ) -> torch.Tensor:
        leaf = self.w.detach().requires_grad_()
        views = {n: part.reshape(len(leaf), *shape) for n, part, shape in
                 zip(self.names, leaf.split(self.sizes, dim=1), self.shapes, strict=True)}
        out = self.forward(views, x)
        losses = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        loss = (losses.view_as(weight) * weight).sum()
        (g,) = torch.autograd.grad(loss, leaf)
        self.g.copy_(g)
        return loss.detach()


def train_learners(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   cfg: TrainConfig, spec: LearnerSpec, *, seed: int,
                   group: dist.ProcessGroup | None = None,
                   state: LearnerState | None = None,
                   on_step: StepHook | None = None) -> float:
    """Train ``spec.learners`` learners on this process (and every process of ``group``,
    when torch.distributed is initialised) with SMA from ``module``'s parameters; write
    the average model ``z`` into ``module``; the mean training loss over all learners'
    batches. Every process calls it with the same data, config, seed and start.
    ``state``: this process's learners from the silo's last round, updated in place
    (None: every learner starts at the module's parameters, nothing is kept)."""
    check_learners(module, cfg)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    count, total = spec.learners, spec.learners * world
    check_correction(spec, world)
    alpha = spec.alpha(world)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    start = torch.cat([params[n].detach().reshape(-1) for n in names])
    kept = state if state is not None and state.fits(count, len(start)) else None
    z = start.clone()
    w = start + kept.offsets if kept is not None else start.repeat(count, 1)
    drift = kept.drift.clone() if kept is not None else torch.zeros_like(z)  # z - z_prev
    buf = kept.momentum.clone() if kept is not None and kept.momentum is not None else None
    g, c, c_sum = torch.empty_like(w), torch.empty_like(w), torch.empty_like(z)
    learners = BatchedMLP.of(module, names) or AutogradLearners(module, names)
    learners.bind(w, g)
    module.train()
    index, weight, has = batch_plan(len(x), cfg, seed, total, start.device)
    mine = slice(rank * count, (rank + 1) * count)
    index, weight, has = index[:, mine], weight[:, mine], has[:, mine]
    full = has.all(1).tolist()  # steps where every learner here has a batch
    plan = zip(index.unbind(0), y[index].unbind(0), weight.unbind(0), strict=True)
    losses: list[torch.Tensor] = []  # each step's summed loss
    for s, (idx, targets, wt) in enumerate(plan):
        on = has[s, :, None]
        losses.append(learners.loss_and_grad(x[idx], targets, wt))
        step = g
        if not full[s]:  # the last step: learners without a batch take no gradient step
            step = g.mul_(on)
        if cfg.weight_decay:
            step = step.add_(w * on if not full[s] else w, alpha=cfg.weight_decay)
        if cfg.momentum:
            if buf is None:
                buf = step.clone()
            elif full[s]:
                buf.mul_(cfg.momentum).add_(step)
            else:
                buf = torch.where(on, cfg.momentum * buf + step, buf)
            step = buf if full[s] else buf * on
        torch.sub(w, z, out=c).mul_(alpha)  # c_j, at the pre-step w_j
        w.sub_(step, alpha=cfg.lr).sub_(c)
        torch.sum(c, dim=0, out=c_sum)
        if world > 1:
            dist.all_reduce(c_sum, group=group)
        z.add_(drift.mul_(spec.momentum).add_(c_sum))  # z += sum_j c_j + mu (z - z_prev)
        if on_step is not None:
            on_step(s, w, z)
    if state is not None:
        state.keep(w - z, drift, buf)
    loss_sum = torch.stack(losses).double().sum() if losses else torch.zeros(
        (), dtype=torch.float64, device=start.device)
    batches = has.sum().double()
    with torch.no_grad():
        offset = 0
        for n in names:
            p = params[n]
            p.copy_(z[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    figures = torch.stack([loss_sum, batches])
    if world > 1:
        dist.all_reduce(figures, group=group)
    return float(figures[0] / figures[1].clamp(min=1))
