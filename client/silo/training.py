"""Local training inside a silo: data-parallel (DDP) over the silo's processes or GPUs.

Every rank draws the same batch order from the round's seed, exactly as single-process
training does (``client.training.train``), and takes its share of each batch: rank r
the positions r, r + P, r + 2P, ... of the batch. Each rank's loss is its share of the
batch's summed loss times P over the batch size, so the gradient DDP averages over the
P ranks is exactly the full batch's mean gradient, even when the shares differ in size.
P processes therefore follow the trajectory of one process on the same data (up to the
order of float additions). DDP allreduces the gradients bucket by bucket while backward
is still running, and broadcasts rank 0's parameters when it wraps the module, so only
rank 0 has to load the global model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from client.training import TrainConfig, make_optimizer


def check_silo_training(cfg: TrainConfig) -> None:
    """Settings that data-parallel training inside a silo cannot honour (a clear error)."""
    if cfg.dp_sgd:
        raise ValueError("DP-SGD (train.dp_sgd_noise_multiplier > 0) clips per-sample gradients "
                         "in one process; it is not supported in a silo with several "
                         "processes: start the silo with --nproc-per-node 1, or use dp.mode = "
                         "'local'")


def train_ddp(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, *,
              seed: int, group: dist.ProcessGroup | None = None) -> float:
    """Train ``module`` in place on every rank of ``group``; the mean training loss.

    All ranks call it with the same data (``x``, ``y`` on the module's device), config
    and seed; rank 0's parameters are the starting point of every rank. With
    ``cfg.proximal_mu > 0`` the FedProx term pulls towards those starting parameters.
    """
    check_silo_training(cfg)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=ids, process_group=group)
    params = [p for p in module.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params] if cfg.proximal_mu > 0 else []
    module.train()
    opt = make_optimizer(params, cfg)
    gen = torch.Generator().manual_seed(seed)
    n = len(x)
    local = torch.zeros((), dtype=torch.float64, device=device)  # this rank's share of losses
    steps = 0
    for _ in range(cfg.local_epochs):
        order = torch.randperm(n, generator=gen)
        for begin in range(0, n, cfg.batch_size):
            idx = order[begin:begin + cfg.batch_size]
            mine = idx[rank::world].to(x.device)
            opt.zero_grad(set_to_none=True)
            summed = F.cross_entropy(ddp(x[mine]), y[mine], reduction="sum")
            loss = summed * (world / len(idx))
            share = summed.detach() / len(idx)
            if cfg.proximal_mu > 0:
                prox = 0.5 * cfg.proximal_mu * sum(torch.sum((p - g) ** 2)
                                                   for p, g in zip(params, start, strict=True))
                loss = loss + prox  # equal on every rank: DDP's average keeps it once
                share = share + prox.detach() / world
            loss.backward()
            opt.step()
            local += share
            steps += 1
    dist.all_reduce(local, group=group)
    return float(local) / max(steps, 1)
