"""``fedring deploy up|down`` and ``fedring certs``: argument parsing and printing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from simulations.deploy.commands import DEFAULT_DB, FEDERATION, MODES, STATE_DIR, Options
from simulations.deploy.deployment import describe, down, up
from simulations.deploy.processes import DeployError


def cmd_up(args: Any) -> int:
    opts = Options(nodes=args.nodes, tls=args.tls or args.auth, auth=args.auth, db=args.db,
                   state_dir=Path(args.dir), federation=args.federation, mode=args.mode,
                   pull_interval=args.pull_interval, threads=args.threads,
                   timeout_s=args.timeout)
    try:
        state = up(opts)
    except DeployError as exc:
        print(f"fedring: error: {exc}", file=sys.stderr)
        return 1
    print(describe(state))
    return 0


def cmd_down(args: Any) -> int:
    try:
        stopped = down(Path(args.dir) if args.dir else None)
    except DeployError as exc:
        print(f"fedring: error: {exc}", file=sys.stderr)
        return 1
    print(f"stopped {len(stopped)} process(es)" + (f": {stopped}" if stopped else
                                                   " (nothing was running)"))
    return 0


def cmd_certs(args: Any) -> int:
    from simulations.certs import write_all

    hosts = [h for h in args.hosts.split(",") if h]
    try:
        m = write_all(Path(args.out), nodes=args.nodes, hosts=hosts)
    except OSError as exc:
        raise ValueError(f"cannot write the certificates to {args.out}: {exc.strerror} "
                         f"({exc.filename}); give --out a directory you can write") from None
    print(f"CA {m.ca}\nSuperLink {m.server_cert} {m.server_key} (for {', '.join(hosts)})")
    for (cert, key), (auth, pub), secagg in zip(m.node_certs, m.auth_keys, m.secagg_keys,
                                                strict=True):
        print(f"SuperNode {cert} {key}; auth key {auth} (register {pub}); "
              f"SecAgg+ identity {secagg}")
    if m.secagg_trusted is not None:
        print(f"SecAgg+ trusted keys {m.secagg_trusted} (give to every SuperNode)")
    return 0


def add_parsers(sub: Any) -> None:
    """Add ``deploy`` and ``certs`` to the ``fedring`` command's subparsers."""
    dep = sub.add_parser("deploy", help="start/stop a Flower SuperLink and SuperNodes locally")
    dep_sub = dep.add_subparsers(dest="deploy_command", required=True)
    upp = dep_sub.add_parser("up", help="start a SuperLink and N SuperNodes on 127.0.0.1")
    upp.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (default 3)")
    upp.add_argument("--tls", action="store_true", help="TLS with a generated development CA")
    upp.add_argument("--auth", action="store_true",
                     help="SuperNode authentication with registered keys (implies --tls)")
    upp.add_argument("--db", default=DEFAULT_DB, help="run store URL for the flwr run command")
    upp.add_argument("--mode", choices=MODES, default="fedring",
                     help="fedring: warm executors and short waits (default); warm: "
                          "warm executors only; fastpoll: short waits only; flower: "
                          "Flower's defaults")
    upp.add_argument("--pull-interval", type=float, default=0.2,
                     help="seconds between an idle SuperNode's pulls (fedring mode)")
    upp.add_argument("--threads", type=int,
                     help="torch threads per ClientApp (0: torch's default; by default the "
                          "cores divided among the SuperNodes in fedring mode)")
    upp.add_argument("--federation", default=FEDERATION, help="name of the federation entry")
    upp.add_argument("--dir", default=str(STATE_DIR), help="state, logs and certificates")
    upp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for start")
    upp.set_defaults(func=cmd_up)
    dwn = dep_sub.add_parser("down", help="stop the processes `deploy up` started")
    dwn.add_argument("--dir", help="the --dir given to `up` (default: where `up` recorded "
                                   f"it in Flower's home, else {STATE_DIR})")
    dwn.set_defaults(func=cmd_down)

    crt = sub.add_parser("certs", help="write a development CA, TLS certificates and node keys")
    crt.add_argument("--out", default=str(STATE_DIR / "certs"), help="output directory")
    crt.add_argument("--nodes", type=int, default=3, help="SuperNode certificates and keys")
    crt.add_argument("--hosts", default="127.0.0.1,localhost,::1",
                     help="comma-separated SuperLink host names/IPs for its certificate")
    crt.set_defaults(func=cmd_certs)
