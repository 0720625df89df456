"""``fedring silo``: start a silo, a torch.distributed job whose rank 0 is a Flower client.

One machine, four processes (or GPUs), next to a SuperNode started with
``--isolation process`` whose Runtime API listens on 127.0.0.1:9094::

    fedring silo --nproc-per-node 4 --runtime-api-address 127.0.0.1:9094 --insecure

Two machines, four processes each (run on both, with their own ``--node-rank``; the
SuperNode runs next to node 0)::

    fedring silo --nnodes 2 --node-rank 0 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29400 \\
        --runtime-api-address 127.0.0.1:9094 --insecure

It runs ``torchrun`` (``python -m torch.distributed.run``) with ``simulations.silo_worker``
as the program of every process, and replaces itself with it; ``--dry-run`` prints the
command instead. The options are checked before anything starts.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.silo.options import DEVICES, add_worker_options

WORKER_MODULE = "simulations.silo_worker"


@dataclass(frozen=True)
class SiloLaunch:
    """What ``fedring silo`` was asked to start."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    runtime_api_address: str = "127.0.0.1:9094"
    insecure: bool = False
    root_certificates: str | None = None
    device: str = "auto"
    timeout_s: float = 300.0
    threads: int = 0
    poll_s: float = 0.05
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes "
                             f"{self.nnodes}, got {self.node_rank}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a silo over several machines needs --rdzv-endpoint HOST:PORT, an "
                             "address of node 0 that every node can reach")
        if self.rdzv_endpoint is not None:
            _host_port(self.rdzv_endpoint, "--rdzv-endpoint")
        if self.node_rank == 0:
            _host_port(self.runtime_api_address, "--runtime-api-address")
            if not self.insecure and not self.root_certificates:
                raise ValueError("node 0 talks to its SuperNode's Runtime API: give "
                                 "--insecure or --root-certificates CA_PEM")
        if self.root_certificates and not Path(self.root_certificates).is_file():
            raise ValueError(f"--root-certificates {self.root_certificates}: no such file")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got "
                             f"'{self.device}'")
        if self.device == "cuda":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus < self.nproc_per_node:
                raise ValueError(f"--device cuda needs one GPU per process: "
                                 f"--nproc-per-node {self.nproc_per_node}, {gpus} GPU(s) here")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.threads < 0 or self.max_restarts < 0 or not self.poll_s > 0:
            raise ValueError("--threads and --max-restarts must be >= 0 and --poll > 0")


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got '{text}'")
    return host, int(port)


def torchrun_command(launch: SiloLaunch) -> list[str]:
    """The ``torchrun`` command line that starts the silo's processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(launch.nnodes),
           "--nproc-per-node", str(launch.nproc_per_node),
           "--max-restarts", str(launch.max_restarts)]
    if launch.rdzv_endpoint:
        cmd += ["--node-rank", str(launch.node_rank), "--rdzv-endpoint", launch.rdzv_endpoint]
    else:
        cmd.append("--standalone")  # one machine: rendezvous on a free local port
    cmd += ["-m", WORKER_MODULE, "--device", launch.device, "--timeout", f"{launch.timeout_s:g}",
            "--threads", str(launch.threads), "--poll", f"{launch.poll_s:g}",
            "--runtime-api-address", launch.runtime_api_address]
    if launch.root_certificates:
        cmd += ["--root-certificates", launch.root_certificates]
    elif launch.insecure:
        cmd.append("--insecure")
    return cmd


def silo_env() -> dict[str, str]:
    """This environment, with the project importable by the silo's processes."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    return env


def launch_from_args(args: Any) -> SiloLaunch:
    return SiloLaunch(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                      runtime_api_address=args.runtime_api_address, insecure=args.insecure,
                      root_certificates=args.root_certificates, device=args.device,
                      timeout_s=args.timeout, threads=args.threads, poll_s=args.poll,
                      max_restarts=args.max_restarts)


def cmd_silo(args: Any) -> int:
    cmd = torchrun_command(launch_from_args(args))  # raises ValueError on a bad option
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execve(sys.executable, cmd, silo_env())
    return 0  # not reached


def add_parser(sub: Any) -> None:
    """Add ``silo`` to the ``fedring`` command's subparsers."""
    p = sub.add_parser("silo", help="run a silo: a torchrun DDP job as a Flower client")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="processes on this machine (one per GPU with --device cuda)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the silo (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's rank (0: the one "
                                                             "next to the SuperNode)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="node 0's address for the silo's rendezvous (several machines)")
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094", metavar="HOST:PORT",
                   help="the Runtime API of the SuperNode started with --isolation process")
    add_worker_options(p)
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts of the silo's processes after a failure")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.set_defaults(func=cmd_silo)
