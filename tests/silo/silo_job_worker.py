"""Run by torchrun in the learner tests: a silo job of two processes trains SMA learners.

Rank 0 leads as ``client.silo.job.run_silo`` does: it trains through ``SiloGroup.train``
with a learner spec, which publishes the command the other rank follows (``follow``),
then stops it. Rank 0 writes its trained model and the followers' (gathered) as JSON.
Arguments: the output path, then the scenario as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from client.app import training_seed
from client.protocol.learners import LearnerSpec
from client.silo.app import WorkerCache
from client.silo.job import SiloGroup, _init_group, follow
from simulations.task import ScenarioTask, task_spec


def main(out: str, config_json: str) -> None:
    config = json.loads(config_json)
    store, rank, size = _init_group("gloo", 120.0, True)
    group = SiloGroup(store, rank=rank, size=size)
    key = json.dumps(task_spec(config), sort_keys=True)
    workers = WorkerCache(lambda spec: ScenarioTask(spec), torch.device("cpu"))
    worker = workers.get(key)
    if rank != 0:  # followers start elsewhere: rank 0's model must reach them
        with torch.no_grad():
            for p in worker.module.parameters():
                p.add_(1.0)
        follow(group, workers)
    else:
        spec = LearnerSpec(2, momentum=0.5, correction=0.2)
        loss = group.train(worker, key, 0, training_seed(worker.task.seed, 1, 0), spec)
        with torch.no_grad():  # round 2 from another model: the learners carry on from it
            for p in worker.module.parameters():
                p.add_(0.01)
        loss = group.train(worker, key, 0, training_seed(worker.task.seed, 2, 0), spec)
        group.stop()
    vec = torch.cat([p.detach().reshape(-1) for p in worker.module.parameters()])
    gathered = [torch.empty_like(vec) for _ in range(size)]
    dist.all_gather(gathered, vec)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": loss, "models": [g.tolist() for g in gathered]}, f)
    dist.barrier()
    os._exit(0)  # as ddp_worker.py: skip gloo's teardown, everything under test is done


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
