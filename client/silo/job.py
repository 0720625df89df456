"""A silo: one Flower client that is a torch.distributed job, launched with ``torchrun``.

Rank 0 (the leader) talks to Flower: it is a warm ClientApp executor for one SuperNode
started with ``--isolation process`` (``client.executor``), serving the silo ClientApp
(``client.silo.app``) whatever app the run's FAB names. The other ranks follow: for each
training task the leader publishes a small command (task, partition, seed) in the job's
rendezvous store, and every rank then trains the same model data-parallel
(``client.silo.training.train_ddp``); DDP hands rank 0's parameters, the global model,
to all ranks. With ``silo.learners`` > 1 the command carries the learner spec and every
rank trains its learners with SMA instead (``client.silo.learners``), from rank 0's model,
which the leader broadcasts first. Only the leader joins cross-silo rings and replies.

On CPUs the processes form a gloo group; with ``--device cuda`` (or ``auto`` where CUDA
is present) each process drives the GPU of its local rank over NCCL. A rank that dies
ends the job (``torchrun`` stops the others); one that hangs makes the others' next
collective fail after ``--timeout`` seconds, and the leader's task fails with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from client.executor import WarmExecutor
from client.protocol.learners import LearnerSpec
from client.silo.app import SiloClient, SiloWorker, WorkerCache, make_silo_client_app
from client.silo.learners import check_correction, check_learners, train_learners
from client.silo.options import DEVICES, add_worker_options
from client.silo.ring import loopback_interface, warm_up
from client.silo.training import check_silo_training, train_ddp
from client.task import SpecResolver, TaskFactory

log = logging.getLogger("fedring.silo")


def pick_device(choice: str, local_rank: int) -> torch.device:
    """The device of this rank: ``cuda:<local rank>`` or the CPU (a clear error if impossible)."""
    if choice not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got '{choice}'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here; use --device cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} "
                         "visible; lower --nproc-per-node")
    return torch.device("cuda", local_rank)


class SiloGroup:
    """The processes of one silo: the leader publishes commands, followers wait for them.

    Commands travel through the job's rendezvous store, not through a collective, so a
    follower may wait for the next task for as long as the silo is idle.
    """

    def __init__(self, store: Any, *, rank: int, size: int, poll_s: float = 0.02) -> None:
        self.store, self.rank, self.size, self.poll_s = store, rank, size, poll_s
        self._seq = 0

    def publish(self, command: Mapping[str, Any]) -> None:
        """Leader: make ``command`` the followers' next one."""
        self._seq += 1
        self.store.set(f"cmd/{self._seq}", json.dumps(dict(command)))

    def next_command(self) -> dict[str, Any]:
        """Follower: block until the leader publishes the next command."""
        self._seq += 1
        key = f"cmd/{self._seq}"
        while not self.store.check([key]):  # idle: the leader has no task yet
            time.sleep(self.poll_s)
        return json.loads(self.store.get(key))

    def train(self, worker: SiloWorker, task_key: str, pid: int, seed: int,
              learners: LearnerSpec | None = None, run: int = 0) -> float:
        """Leader: train ``worker``'s module with every rank of the silo (DDP, or SMA
        learners when ``learners`` asks for more than one), on the partition less its
        held-out split. ``run``: the Flower run (each rank keeps its learners per run)."""
        check_silo_training(worker.task.train_config)  # before any follower starts
        command: dict[str, Any] = {"op": "train", "task": task_key, "partition": pid,
                                   "seed": seed}
        if learners is not None and learners.learners > 1:
            check_learners(worker.module, worker.task.train_config)  # likewise
            check_correction(learners, self.size)
            command["learners"] = asdict(learners)
            command["run"] = run
        self.publish(command)
        return train_rank(worker, pid, seed, learners, run)

    def stop(self) -> None:
        """Leader: tell the followers to exit."""
        self.publish({"op": "stop"})


def follow(group: SiloGroup, workers: WorkerCache) -> int:
    """Follower loop: train on every command until the leader says stop; tasks done."""
    done = 0
    while True:
        cmd = group.next_command()
        if cmd.get("op") == "stop":
            return done
        worker = workers.get(cmd["task"])
        spec = LearnerSpec(**cmd["learners"]) if "learners" in cmd else None
        train_rank(worker, int(cmd["partition"]), int(cmd["seed"]), spec, int(cmd.get("run", 0)))
        done += 1


def train_rank(worker: SiloWorker, pid: int, seed: int, learners: LearnerSpec | None,
               run: int = 0) -> float:
    """This rank's part of the silo's training on partition ``pid``: DDP, or SMA learners
    from rank 0's model (this rank's learners kept between rounds)."""
    x, y = worker.partition(pid)
    if learners is None or learners.learners == 1:
        return train_ddp(worker.module, x, y, worker.task.train_config, seed=seed)
    with torch.no_grad():  # DDP broadcasts rank 0's parameters when it wraps the module
        for p in worker.module.parameters():
            dist.broadcast(p, src=0)
    return train_learners(worker.module, x, y, worker.task.train_config, learners, seed=seed,
                          state=worker.learner_state(run, pid))


class SiloExecutor(WarmExecutor):
    """The warm executor, serving the silo's own ClientApp instead of loading the FAB's."""

    def __init__(self, app: Any, runtime_api_address: str, **kwargs: Any) -> None:
        super().__init__(runtime_api_address, **kwargs)
        self._silo_app = app

    def _load(self, run: Any, fab: Any) -> Any:
        return self._silo_app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="silo worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                        help="the SuperNode's Runtime API (rank 0 only)")
    add_worker_options(parser)
    return parser


def _init_group(backend: str, timeout_s: float, single_node: bool) -> tuple[Any, int, int]:
    """Join torchrun's job: the default process group and the job's store."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, size = next(rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    saved, lo = os.environ.get("GLOO_SOCKET_IFNAME"), loopback_interface()
    if single_node and saved is None and lo:
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # one machine: keep the group on loopback
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    return dist.PrefixStore("fedring-silo", store), rank, size


def run_silo(argv: list[str] | None, task_factory: TaskFactory,
             resolve_spec: SpecResolver) -> int:
    """Body of every process of a silo started by ``torchrun`` (see ``fedring silo``)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if "RANK" not in os.environ:
        raise SystemExit("a silo worker runs under torchrun: start it with `fedring silo`")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as exc:
        raise SystemExit(f"fedring silo: {exc}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    store, rank, size = _init_group("nccl" if device.type == "cuda" else "gloo",
                                    args.timeout, single_node)
    group = SiloGroup(store, rank=rank, size=size)
    try:
        if rank != 0:
            done = follow(group, WorkerCache(task_factory, device))
            log.info("rank %d: stopping after %d task(s)", rank, done)
            return 0
        warm_up()  # the first ring must not wait for its process server to start
        certs = Path(args.root_certificates).read_bytes() if args.root_certificates else None
        client = SiloClient(task_factory, resolve_spec, group=group, device=device)
        executor = SiloExecutor(make_silo_client_app(client), args.runtime_api_address,
                                insecure=certs is None, root_certificates=certs,
                                poll_s=args.poll)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        log.info("silo of %d process(es) on %s polling %s", size, device,
                 args.runtime_api_address)
        try:
            executor.serve_forever()
        except KeyboardInterrupt:
            log.info("stopping after %d task(s)", executor.tasks_done)
        finally:
            group.stop()
        return 0
    finally:
        dist.destroy_process_group()
