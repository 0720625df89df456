"""The ``fedring`` command: simulate, runs, report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_DB = "sqlite:///runs/fedring.db"
ENGINES = ("inprocess", "flower")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    from simulations.config import load_scenario

    values: dict[str, Any] = {}
    if args.clients is not None:
        values["federation.clients"] = args.clients
    if args.rounds is not None:
        values["federation.rounds"] = args.rounds
    if args.seed is not None:
        values["seed"] = args.seed
    if getattr(args, "target_accuracy", None) is not None:
        values["driver.target_accuracy"] = args.target_accuracy
    return load_scenario(args.scenario, args.set, values=values)


def run_simulation(config: dict[str, Any], *, engine: str, db: str,
                   reporter: Any = None, resume: str | None = None) -> dict[str, Any]:
    """Run a resolved scenario on an engine with fedring's ServerApp and ClientApp
    (``resume``: continue that run from its last checkpoint)."""
    from flwr.app import Context, RecordDict

    from server.app import make_server_app
    from simulations.apps import (
        build_task,
        client_app,
        cohort_hook,
        config_from_run_config,
        spec_from_run_config,
    )
    from simulations.heterogeneity import make_clock

    build_task(config)  # fails here, before any engine starts, on bad data or model settings
    cross_silo = config.get("driver", {}).get("kind") == "cross_silo"
    if cross_silo and engine != "inprocess":
        raise ValueError("driver.kind 'cross_silo' needs every silo of a ring running at once: "
                         "use --engine inprocess, or deploy silos with `fedring silo`")
    result: dict[str, Any] = {}
    server_app = make_server_app(build_task, config_from_run_config, config=config,
                                 store_url=db, reporter=reporter, on_summary=result.update,
                                 resume=resume, clock=None if cross_silo else make_clock)
    clients = config["federation"]["clients"]
    if engine == "inprocess":
        from simulations.inprocess import InProcessGrid

        if cross_silo:  # silos on threads, each joining its ring from a process of its own
            from simulations.silo_engine import ConcurrentGrid, silo_client_app
            from simulations.task import ScenarioTask

            grid = ConcurrentGrid(silo_client_app(ScenarioTask, spec_from_run_config), clients)
        else:
            grid = InProcessGrid(client_app, clients,
                                 cohort_hook=cohort_hook(
                                     config.get("engine", {}).get("vectorize", False)))
        server_app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                 state=RecordDict(), run_config={"db": db}))
    elif engine == "flower":
        from flwr.simulation import run_simulation as flower_run_simulation

        flower_run_simulation(server_app=server_app, client_app=client_app,
                              num_supernodes=clients,
                              backend_config={"client_resources": {"num_cpus": 1,
                                                                   "num_gpus": 0.0}})
    else:
        raise ValueError(f"unknown engine '{engine}'; choose one of: {', '.join(ENGINES)}")
    if not result:
        raise RuntimeError(f"the {engine} engine finished without a result; see its log above")
    return result


def _stored_config(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration a run to resume was started with (it cannot change on resume)."""
    from server.store import Store

    changed = [flag for flag, value in (("--clients", args.clients), ("--rounds", args.rounds),
                                        ("--seed", args.seed), ("--set", args.set))
               if value] + (["--scenario"] if args.scenario != "default" else [])
    if changed:
        raise ValueError(f"--resume continues a run with its stored configuration; drop "
                         f"{', '.join(changed)}")
    with Store(args.db) as store:
        return store.get_run(args.resume).config


def _attackers(config: dict[str, Any]) -> list[int] | None:
    """The partition ids of a run's simulated attackers, or None without ``[attack]``."""
    from simulations.task import ScenarioTask

    attack = ScenarioTask.from_config(config).attack
    return None if attack is None else sorted(attack.attackers)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from simulations.progress import RichReporter

    config = _stored_config(args) if args.resume else _resolve(args)
    console = Console(stderr=True)
    with RichReporter(config["federation"]["rounds"], console=console) as reporter:
        summary = run_simulation(config, engine=args.engine, db=args.db, reporter=reporter,
                                 resume=args.resume)
    summary = {**summary, "engine": args.engine, "scenario": config["name"],
               "clients": config["federation"]["clients"]}
    attackers = _attackers(config)
    if attackers is not None:
        summary["attackers"] = attackers
    privacy = ""
    if "epsilon" in summary:
        privacy = (f", epsilon {summary['epsilon']:.3f} against the "
                   f"{summary['protects_against']}")
        if "epsilon_model" in summary:
            privacy += (f", epsilon_model {summary['epsilon_model']:.3f} against the "
                        "released model")
        privacy += f" at delta {summary['delta']:g}"
    if summary.get("epsilon_audit") is not None:
        privacy += f", epsilon_audit {summary['epsilon_audit']:.3f}"
    console.print(f"[bold green]{summary['status']}[/]: run {summary['run_id']}, "
                  f"{summary['rounds']} rounds, accuracy {summary['final_accuracy']:.4f}, "
                  f"loss {summary['final_loss']:.4f}{privacy}, {summary['wall_s']:.1f} s, "
                  f"store {summary['store']}")
    if summary.get("stop_reason"):
        console.print(f"[yellow]{summary['stop_reason']}")
    if summary.get("status") == "failed":
        console.print("[bold red]no round applied an update[/]: see the rejected and dropped "
                      f"updates with `fedring report {summary['run_id']}`")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary.get("status") != "failed" else 1


def cmd_runs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from server.store import Store

    with Store(args.db) as store:
        runs = store.list_runs()
    table = Table(title=f"runs in {args.db}")
    for col in ("run", "name", "status", "seed", "rounds", "accuracy", "created"):
        table.add_column(col)
    for r in runs:
        acc = (r.summary or {}).get("final_accuracy")
        table.add_row(r.run_id, r.name or "", r.status, str(r.seed), str(r.num_rounds),
                      "" if acc is None else f"{acc:.4f}", str(r.created_at)[:19])
    Console().print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from server.store import Store
    from simulations.report import audit_line, plot_run, privacy_summary, round_table

    with Store(args.db) as store:
        info = store.get_run(args.run_id)
        rows = round_table(store.rounds(args.run_id), store.secagg_rounds(args.run_id))
        privacy = privacy_summary(store.privacy_ledger(args.run_id), info.config)
        path = plot_run(store, args.run_id, Path(args.out))
    table = Table(title=f"run {info.run_id} ({info.name}, {info.status})")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    console = Console()
    console.print(table)
    if privacy is not None:
        console.print(privacy)
    if audit_line(info.summary) is not None:
        console.print(audit_line(info.summary))
    console.print(f"plot: {path}")
    return 0


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedring", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run a federated simulation")
    sim.add_argument("--scenario", default="default",
                     help="scenario name in simulations/scenarios/ or a TOML path")
    sim.add_argument("--clients", type=int, help="number of clients (federation.clients)")
    sim.add_argument("--rounds", type=int, help="number of rounds (federation.rounds)")
    sim.add_argument("--seed", type=int, help="run seed")
    sim.add_argument("--db", default=DEFAULT_DB, help="SQLAlchemy URL of the run store")
    sim.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a scenario key (repeatable)")
    sim.add_argument("--engine", choices=ENGINES, default="inprocess",
                     help="inprocess (default, fastest) or flower (Flower's Ray simulation)")
    sim.add_argument("--target-accuracy", type=float, metavar="A",
                     help="stop once central test accuracy reaches A (driver.target_accuracy)")
    sim.add_argument("--json", action="store_true", help="end with one JSON summary line")
    sim.add_argument("--resume", metavar="RUN_ID",
                     help="continue a run from its last checkpoint (same --db)")
    sim.set_defaults(func=cmd_simulate)

    runs = sub.add_parser("runs", help="list runs in the store")
    runs.add_argument("--db", default=DEFAULT_DB)
    runs.set_defaults(func=cmd_runs)

    rep = sub.add_parser("report", help="per-round table and plot of a run")
    rep.add_argument("run_id")
    rep.add_argument("--db", default=DEFAULT_DB)
    rep.add_argument("--out", default="runs", help="directory for the PNG plot")
    rep.set_defaults(func=cmd_report)

    from simulations.deploy import add_parsers as add_deploy_parsers

    add_deploy_parsers(sub)  # deploy up/down, certs

    from simulations.silo_cli import add_parser as add_silo_parser

    add_silo_parser(sub)  # silo: a torchrun job as one Flower client
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, LookupError) as exc:
        print(f"fedring: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
