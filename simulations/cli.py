"""The ``fedring`` command: simulate, runs, report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.engine_config import EngineConfig

DEFAULT_DB = "sqlite:///runs/fedring.db"
ENGINES = ("inprocess", "flower")
TARGETS = ("central", "federated", "personal")  # server.driver_config.TARGET_METRICS' keys


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
    if getattr(args, "target_on", None) is not None:
        values["driver.target_on"] = args.target_on
    return load_scenario(args.scenario, args.set, values=values)


def engine_on(device: str, engine: EngineConfig) -> EngineConfig:
    """``engine`` with a GPU share per Ray client when clients train on CUDA and
    ``engine.client_gpus`` is not set: as many clients at once as there are cores (Ray
    hides the GPU from actors that ask for none)."""
    if device != "cuda" or engine.client_gpus > 0:
        return engine
    return dataclasses.replace(engine, client_gpus=1.0 / max(1, os.cpu_count() or 1))


def run_simulation(config: dict[str, Any], *, engine: str, db: str,
                   reporter: Any = None, resume: str | None = None) -> dict[str, Any]:
    """Run a resolved scenario on an engine with fedring's ServerApp and ClientApp
    (``resume``: continue that run from its last checkpoint)."""
    from flwr.app import Context, RecordDict

    from client.training import resolve_device
    from server.app import make_server_app
    from simulations.apps import (
        build_task,
        client_app,
        cohort_hook,
        config_from_run_config,
        spec_from_run_config,
    )
    from simulations.attacks import omniscient_attack
    from simulations.heterogeneity import make_clock
    from simulations.tracking import TrackingConfig, open_tracking

    task = build_task(config)  # fails here, before any engine starts, on bad data or model
    TrackingConfig(**config.get("tracking", {})).require()  # and on a missing extra
    device = resolve_device(config["train"]["device"]).type  # clients train on this machine
    kind = config.get("driver", {}).get("kind")
    cross_silo = kind in ("cross_silo", "gossip")  # rounds among silos, over their groups
    if cross_silo and engine != "inprocess":
        raise ValueError(f"driver.kind '{kind}' needs every silo of a round running at once: "
                         "use --engine inprocess, or deploy silos with `fedring silo`")
    result: dict[str, Any] = {}
    # the server uses the task checked above, not a second build (partition 0, evaluation)
    server_app = make_server_app(lambda _config: task, config_from_run_config, config=config,
                                 store_url=db, reporter=reporter, on_summary=result.update,
                                 resume=resume, clock=None if cross_silo else make_clock,
                                 observe=open_tracking, pre_combine=omniscient_attack)
    clients = config["federation"]["clients"]
    if engine == "inprocess":
        from simulations.inprocess import InProcessGrid

        if cross_silo:  # silos on threads, each joining its ring from a process of its own
            from simulations.module_task import make_task
            from simulations.silo_engine import ConcurrentGrid, silo_client_app

            grid = ConcurrentGrid(silo_client_app(make_task, spec_from_run_config), clients)
        else:
            grid = InProcessGrid(client_app, clients,
                                 cohort_hook=cohort_hook(
                                     config.get("engine", {}).get("vectorize", False)))
        server_app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                 state=RecordDict(), run_config={"db": db}))
    elif engine == "flower":
        from simulations.engine_config import EngineConfig
        from simulations.flower_engine import run_on_ray

        run_on_ray(server_app, client_app, num_supernodes=clients,
                   engine=engine_on(device, EngineConfig(**config.get("engine", {}))))
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
    with Store(args.db, create=False) as store:
        return store.get_run(args.resume).config


def _attackers(config: dict[str, Any]) -> list[int] | None:
    """The partition ids of a run's simulated attackers, or None without ``[attack]``."""
    from simulations.attacks import Attack

    attack = Attack.from_spec(config.get("attack"), seed=config["seed"],
                              clients=config["federation"]["clients"])
    return None if attack is None else sorted(attack.attackers)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from server.reporter import federated_text, summary_relations
    from server.store import Store
    from simulations.progress import RichReporter

    config = _stored_config(args) if args.resume else _resolve(args)
    from simulations.apps import build_task

    build_task(config)  # bad data or model settings fail here, before any progress shows
    Store(args.db).close()  # and so does a bad or unreachable --db
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
        relations = summary_relations(summary)
        privacy = (f", epsilon {summary['epsilon']:.3f} ({relations['epsilon']}) against "
                   f"the {summary['protects_against']}")
        if "epsilon_replace_one" in summary:
            privacy += (f", epsilon_replace_one {summary['epsilon_replace_one']:.3f} "
                        "(replace-one)")
        if "epsilon_model" in summary:
            privacy += (f", epsilon_model {summary['epsilon_model']:.3f} "
                        f"({relations['epsilon_model']}) against the released model")
        privacy += f" at delta {summary['delta']:g}"
    if summary.get("epsilon_audit") is not None:
        privacy += f", epsilon_audit {summary['epsilon_audit']:.3f}"
        if summary.get("epsilon_audit_lower") is not None:
            privacy += f" (95% lower bound {summary['epsilon_audit_lower']:.3f}"
            if summary.get("epsilon_audit_reference") is not None:
                privacy += (f", exact {summary['epsilon_audit_reference']:.3f} "
                            f"({summary.get('audit_relation')})"
                            + (", FLAGGED" if summary.get("audit_flag") else ""))
            privacy += ")"
    if summary.get("dp_sgd_epsilon") is not None:
        privacy += (f", dp_sgd_epsilon {summary['dp_sgd_epsilon']:.3f} "
                    f"({summary['dp_sgd_relation']}, the largest over clients) protecting "
                    f"{summary['dp_sgd_protects']} against "
                    f"{summary['dp_sgd_protects_against']} at delta {summary['dp_sgd_delta']:g}")
    central = ", ".join(f"{name} {summary[key]:.4f}" for name, key in
                        (("accuracy", "final_accuracy"), ("loss", "final_loss"))
                        if summary.get(key) is not None) or "no central evaluation"
    if federated := federated_text(summary):
        central += f", {federated}"
    took = f"{summary['wall_s']:.1f} s"
    if "resumed_after_round" in summary:
        took += f" since resuming ({summary['wall_s_total']:.1f} s for the whole run)"
    console.print(f"[bold green]{summary['status']}[/]: run {summary['run_id']}, "
                  f"{summary['rounds']} rounds, {central}{privacy}, {took}, "
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
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from server.store import Store
    from simulations.report import RUN_COLUMNS, run_row

    with Store(args.db, create=False) as store:
        runs = [run_row(r) for r in store.list_runs()]
    if args.json:
        print(json.dumps(runs))
        return 0
    table = Table(title=f"runs in {args.db}", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
                  show_edge=False)
    for col in RUN_COLUMNS:  # ids and dates are never cut
        table.add_column(col, no_wrap=col in ("run", "created", "status"))
    for r in runs:
        table.add_row(*(_fmt(r[c]) for c in RUN_COLUMNS[:-1]), r["created"][:16])
    Console().print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from server.store import Store
    from simulations.report import (
        HEADERS,
        audit_line,
        fit_columns,
        plot_run,
        privacy_summary,
        report_columns,
        round_table,
        run_row,
    )

    with Store(args.db, create=False) as store:
        info = store.get_run(args.run_id)
        rows = round_table(store.rounds(args.run_id), store.secagg_rounds(args.run_id))
        privacy = privacy_summary(store.privacy_ledger(args.run_id))
        path = None if args.json else plot_run(store, args.run_id, Path(args.out))
    if args.json:
        print(json.dumps({**run_row(info), "summary": info.summary, "privacy": privacy,
                          "audit": audit_line(info.summary), "rounds_table": rows},
                         default=str))
        return 0

    def table_of(columns: list[str], titled: bool = True) -> Table:
        table = Table(title=f"run {info.run_id} ({info.name}, {info.status})" if titled
                      else None,
                      box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
        for col in columns:
            table.add_column(HEADERS.get(col, col), no_wrap=True)
        for row in rows:  # blank where a round has no such figure (e.g. no evaluation)
            table.add_row(*(_fmt(row.get(c)) for c in columns))
        return table

    console = Console()
    columns = report_columns(rows, wide=args.wide)
    if not args.wide:
        columns = fit_columns(columns, rows, lambda cols: _width(table_of(cols, False)),
                              console.width)
    console.print(table_of(columns))
    if not args.wide:
        console.print("more columns (version, sampled, secure rounds' k/t and survivors, "
                      "bytes, train loss, the clients' accuracy spread, ...): --wide")
    if privacy is not None:
        console.print(privacy)
    if audit_line(info.summary) is not None:
        console.print(audit_line(info.summary))
    if info.summary and info.summary.get("stop_reason"):
        console.print(info.summary["stop_reason"])
    console.print(f"plot: {path}")
    return 0


def _width(renderable: object) -> int:
    """The widest line of ``renderable`` printed without a width limit."""
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=10_000).print(renderable)
    return max((len(line) for line in out.getvalue().splitlines()), default=0)


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
                     help="stop once the accuracy --target-on names reaches A "
                          "(driver.target_accuracy)")
    sim.add_argument("--target-on", choices=TARGETS,
                     help="which accuracy --target-accuracy means (driver.target_on): central "
                          "(default; the server's test set), federated (the global model on "
                          "the clients' held-out splits, example-weighted; needs "
                          "federation.evaluate_fraction > 0) or personal (each client's own "
                          "model there: its own batch norm under FedBN, "
                          "aggregation.local_buffers = true)")
    sim.add_argument("--json", action="store_true", help="end with one JSON summary line")
    sim.add_argument("--resume", metavar="RUN_ID",
                     help="continue a run from its last checkpoint (same --db)")
    sim.set_defaults(func=cmd_simulate)

    runs = sub.add_parser("runs", help="list runs in the store")
    runs.add_argument("--db", default=DEFAULT_DB)
    runs.add_argument("--json", action="store_true", help="print the runs as one JSON list")
    runs.set_defaults(func=cmd_runs)

    rep = sub.add_parser("report", help="per-round table and plot of a run")
    rep.add_argument("run_id")
    rep.add_argument("--db", default=DEFAULT_DB)
    rep.add_argument("--out", default="runs", help="directory for the PNG plot")
    rep.add_argument("--wide", action="store_true", help="every column, not only the essential")
    rep.add_argument("--json", action="store_true",
                     help="print the run and its rounds as one JSON object (no plot)")
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
