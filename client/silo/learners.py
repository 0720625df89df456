"""Several learners per silo process, synchronised by synchronous model averaging (SMA).

Crossbow (Koliousis et al., VLDB 2019, section 3, Algorithm 1) keeps small batches
efficient by training ``L`` independent replicas ("learners") per device and pulling
them together through a central average model ``z``. fedring runs it inside a silo of
``P`` processes, each training its ``L`` learners as ONE batched computation: one
forward of all learners over their stacked parameters (``stacked_forward``: batched
matrix products for a plain ``nn.Sequential`` MLP, else ``torch.func.vmap`` of
``functional_call``) and one backward. Every step, for each of the ``P * L``
learners ``j`` (weights ``w_j``, gradient ``g_j`` of its own batch's mean loss at
``w_j``):

    c_j   = alpha * (w_j - z)                        the correction, at the pre-step w_j
    w_j  <- w_j - lr * g_j - c_j                     (SGD; train.momentum and
                                                      train.weight_decay act on g_j)
    z    <- z + mean_j(c_j) + mu * (z - z_prev)      the mean over all P * L learners

with ``alpha`` = ``silo.sma_correction`` and ``mu`` = ``silo.sma_momentum``. The
corrections are summed over the silo's processes with one ``dist.all_reduce`` of the
silo's group per step (the group DDP uses). Like the paper, the correction is taken at
the learner's weights before its gradient step (the weights the gradient is computed
at), and the learners and ``z`` all start from the global model. Unlike the paper,
whose ``z`` moves by the SUM of the corrections (with ``alpha`` about ``1/L``), ``z``
here moves by their MEAN: ``alpha`` then means the same for any ``P * L``, and, without
momentum, the gap between ``z`` and the learners' mean shrinks by ``1 - 2 * alpha`` per
step, so ``alpha <= 1/2`` never overshoots (``LearnerSpec``).

Batches: every process draws the round's batch order as ``client.training.train`` does
(a seeded ``randperm`` per epoch, batches of ``train.batch_size``); all epochs' batches,
in order, are dealt ``P * L`` per step: learner ``j`` of rank ``r`` (global index
``r * L + j``) takes batch ``s * P * L + r * L + j`` at step ``s``. A learner without a
batch in the last step takes no gradient step but is still corrected. The silo's update
is its average model's delta, ``z_end - start``: ``z_end`` is written into the module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.func import functional_call, vmap
from torch.nn import functional as F

from client.protocol.learners import LearnerSpec
from client.training import TrainConfig

# on_step(step, learners [L, D], z [D]) after every step (tests compare the trajectory)
StepHook = Callable[[int, torch.Tensor, torch.Tensor], None]


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


def deal_batches(n: int, cfg: TrainConfig, seed: int, total: int) -> list[list[torch.Tensor]]:
    """Each step's batches for ``total`` learners (empty tensors where none is left):
    the round's batch order, as ``client.training.train`` draws it, dealt in turn."""
    gen = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    for _ in range(cfg.local_epochs):
        order = torch.randperm(n, generator=gen)
        batches += [order[i:i + cfg.batch_size] for i in range(0, n, cfg.batch_size)]
    empty = torch.zeros(0, dtype=torch.long)
    return [[batches[i] if i < len(batches) else empty for i in range(s, s + total)]
            for s in range(0, len(batches), total)]


def _plan(steps: list[list[torch.Tensor]], width: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index [S, total, width], weight [S, total, width], has [S, total]): every step's
    batches padded with example 0, each real example weighing 1 / its batch's size (a
    mean), padding 0; ``has``: the learner has a batch at that step."""
    total = len(steps[0]) if steps else 0
    index = torch.zeros(len(steps), total, width, dtype=torch.long)
    weight = torch.zeros(len(steps), total, width)
    for s, step in enumerate(steps):
        for j, idx in enumerate(step):
            index[s, j, :len(idx)] = idx
            weight[s, j, :len(idx)] = 1.0 / max(len(idx), 1)
    return index, weight, weight.sum(-1) > 0


Forward = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
ELEMENTWISE = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Identity)


def stacked_forward(module: torch.nn.Module) -> Forward:
    """Every learner's forward at once: ``f(params, x)`` with each parameter stacked
    [L, *shape] and ``x`` [L, B, ...]. An ``nn.Sequential`` of ``Linear``, ``Flatten`` and
    element-wise activations runs as batched matrix products (``baddbmm``); any other
    model as ``vmap`` of ``functional_call`` (a fixed cost of about two plain steps per
    call, measured here on the default MLP)."""
    layers = list(module.children()) if isinstance(module, torch.nn.Sequential) else []
    simple = bool(layers) and all(
        isinstance(m, (torch.nn.Linear, *ELEMENTWISE))
        or (isinstance(m, torch.nn.Flatten) and (m.start_dim, m.end_dim) == (1, -1))
        for m in layers)
    if not simple:
        return vmap(lambda p, xb: functional_call(module, p, (xb,)))
    names = {id(m): name for name, m in module.named_children()}

    def forward(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        for m in layers:
            if isinstance(m, torch.nn.Flatten):
                h = h.flatten(2)
            elif isinstance(m, torch.nn.Linear):
                name = names[id(m)]
                weight = p[f"{name}.weight"].transpose(1, 2)
                bias = p.get(f"{name}.bias")
                h = torch.bmm(h, weight) if bias is None else torch.baddbmm(
                    bias.unsqueeze(1), h, weight)
            else:
                h = m(h)
        return h

    return forward


def train_learners(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   cfg: TrainConfig, spec: LearnerSpec, *, seed: int,
                   group: dist.ProcessGroup | None = None,
                   on_step: StepHook | None = None) -> float:
    """Train ``spec.learners`` learners on this process (and every process of ``group``,
    when torch.distributed is initialised) with SMA from ``module``'s parameters; write
    the average model ``z`` into ``module``; the mean training loss over all learners'
    batches. Every process calls it with the same data, config, seed and start."""
    check_learners(module, cfg)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    device = params[names[0]].device
    start = torch.cat([params[n].detach().reshape(-1) for n in names])
    count, total = spec.learners, spec.learners * world
    w = start.unsqueeze(0).repeat(count, 1).contiguous()  # this process's learners [L, D]
    z, z_prev = start.clone(), start.clone()
    buf: torch.Tensor | None = None  # the learners' SGD momentum

    def views(flat: torch.Tensor) -> dict[str, torch.Tensor]:  # [L, D] -> [L, *shape]
        return {n: part.reshape(len(flat), *shape) for n, part, shape in
                zip(names, flat.split(sizes, dim=1), shapes, strict=True)}

    # one batched forward of every learner over the stacked parameters, then one ordinary
    # backward: each learner's loss depends only on its own row of ``w``
    forward = stacked_forward(module)
    module.train()
    steps = deal_batches(len(x), cfg, seed, total)
    width = max([len(i) for step in steps for i in step] + [1])
    index, weight, has = (t.to(device) for t in _plan(steps, width))
    mine = slice(rank * count, (rank + 1) * count)
    full = has[:, mine].all(1).tolist()  # steps where every learner here has a batch
    kept: list[torch.Tensor] = []  # each step's summed loss
    for s in range(len(steps)):
        idx, wt, on = index[s, mine], weight[s, mine], has[s, mine, None]
        leaf = w.requires_grad_()
        out = forward(views(leaf), x[idx])
        losses = F.cross_entropy(out.flatten(0, 1), y[idx].flatten(), reduction="none")
        loss = (losses.view_as(wt) * wt).sum()
        (g,) = torch.autograd.grad(loss, leaf)
        w = leaf.detach()  # the autograd graph is gone: w may change in place
        kept.append(loss.detach())
        if not full[s]:  # the last step: learners without a batch take no gradient step
            g = g * on
        if cfg.weight_decay:
            g = g.add_(w * on if not full[s] else w, alpha=cfg.weight_decay)
        if cfg.momentum:
            if buf is None:
                buf = g.clone()
            elif full[s]:
                buf = buf.mul_(cfg.momentum).add_(g)
            else:
                buf = torch.where(on, cfg.momentum * buf + g, buf)
            g = buf if full[s] else buf * on
        c = (w - z).mul_(spec.correction)
        w = w.sub_(g, alpha=cfg.lr).sub_(c)
        c_sum = c.sum(0)
        if world > 1:
            dist.all_reduce(c_sum, group=group)
        z_new = torch.add(z, c_sum, alpha=1.0 / total)
        if spec.momentum:
            z_new = z_new.add_(z - z_prev, alpha=spec.momentum)
        z, z_prev = z_new, z
        if on_step is not None:
            on_step(s, w, z)
    loss_sum = torch.stack(kept).double().sum() if kept else torch.zeros(
        (), dtype=torch.float64, device=device)
    batches = has[:, mine].sum().double()
    with torch.no_grad():
        for n, part in views(z.unsqueeze(0)).items():
            params[n].copy_(part[0])
    figures = torch.stack([loss_sum, batches])
    if world > 1:
        dist.all_reduce(figures, group=group)
    return float(figures[0] / figures[1].clamp(min=1))
