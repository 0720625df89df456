"""Run by torchrun in the learner tests: SMA learners split over the job's processes.

Every rank trains two learners with ``train_learners`` over the gloo group; rank 0 also
runs the plain loop of ``sma_reference`` with all four learners and writes, per case,
the largest differences of the learners and of the average model over all steps.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from sma_reference import reference_sma
from test_silo_learners import CASES, build_model, data
from torch.nn.utils import parameters_to_vector

from client.protocol.learners import LearnerSpec
from client.silo.learners import train_learners


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data()
    results = {}
    for name, (cfg, alpha, mu) in CASES.items():
        model = build_model()
        start = parameters_to_vector(model.parameters()).detach().clone()
        steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        train_learners(model, x, y, cfg, LearnerSpec(2, momentum=mu, correction=alpha),
                       seed=5, on_step=lambda s, w, z, kept=steps: kept.append((w.clone(),
                                                                                z.clone())))
        learners = [torch.empty_like(steps[-1][0]) for _ in range(world)]
        everyone: list[list[torch.Tensor]] = []
        for w, _ in steps:  # every step's learners of every rank, in rank order
            dist.all_gather(learners, w)
            everyone.append([t.clone() for t in learners])
        z = parameters_to_vector(model.parameters()).detach()
        zs = [torch.empty_like(z) for _ in range(world)]
        dist.all_gather(zs, z)
        if rank == 0:
            expected = reference_sma(
                build_model(), x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                alpha=alpha, mu=mu, seed=5, total=2 * world)
            results[name] = {
                "steps": len(steps) if len(steps) == len(expected) else -1,
                "learners_diff": max(float((torch.cat(ws) - w_ref).abs().max())
                                     for ws, (w_ref, _) in zip(everyone, expected, strict=True)),
                "z_diff": max(float((z_s - z_ref).abs().max())
                              for (_, z_s), (_, z_ref) in zip(steps, expected, strict=True)),
                "ranks_equal": all(torch.equal(t, z) for t in zs),
                "moved": float((z - start).abs().max()),
            }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    os._exit(0)  # as ddp_worker.py: skip gloo's teardown, everything under test is done


if __name__ == "__main__":
    main(sys.argv[1])
