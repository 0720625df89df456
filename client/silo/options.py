"""The options a silo's processes take, shared by the worker and the ``fedring silo`` launcher
(which passes them through torchrun); argparse only, so the launcher stays light."""

from __future__ import annotations

import argparse

DEVICES = ("auto", "cpu", "cuda")


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """TLS to the Runtime API, device, collective timeout, rank 0's poll, torch threads."""
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
    tls.add_argument("--root-certificates", metavar="CA_PEM",
                     help="CA certificate that signed the SuperNode's --ssl-certfile")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="cuda: one GPU per process over NCCL; cpu: gloo; auto: cuda if "
                             "present")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective inside the silo may wait (default 300)")
    parser.add_argument("--poll", type=float, default=0.05,
                        help="seconds between rank 0's task polls when idle")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads per process (0: torch's default)")
