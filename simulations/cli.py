"""The ``fedring`` command: simulate, runs, report, deploy, certs, silo."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.engine_config import EngineConfig

DEFAULT_DB = "sqlite:///runs/fedring.db"
ENGINES = ("inprocess", "flower")
TARGETS = ("central", "federated", "personal")  # server.driver_config.TARGET_METRICS' keys
LAST_RUN = "last"  # `fedring report last`: the newest run in the store
SIGPIPE_EXIT = 141  # 128 + SIGPIPE: the status of a pipe writer whose reader is gone
MIN_DIFFERS_WIDTH = 24  # narrower, `fedring runs` lists each run's changes below its table
MIN_REASON_WIDTH = 24  # narrower, `report --updates` puts each reason below its update


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
    return load_scenario(args.scenario, args.set, values=values,
                         name=getattr(args, "name", None))


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
    from server.driver_config import DriverConfig
    from server.drivers import driver
    from simulations.apps import (
        build_task,
        client_app,
        cohort_hook,
        config_from_run_config,
        run_pki,
        spec_from_run_config,
    )
    from simulations.attacks import omniscient_attack
    from simulations.heterogeneity import make_clock
    from simulations.tracking import TrackingConfig, open_tracking

    task = build_task(config)  # fails here, before any engine starts, on bad data or model
    TrackingConfig(**config.get("tracking", {})).require()  # and on a missing extra
    device = resolve_device(config["train"]["device"]).type  # clients train on this machine
    kind = DriverConfig(**config.get("driver", {})).kind
    cross_silo = driver(kind).silos  # rounds among silos, over their groups
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
    pki = run_pki(config)  # malicious-mode secure aggregation: each node's identity
    if engine == "inprocess":
        from simulations.inprocess import InProcessGrid

        if cross_silo:  # silos on threads, each joining its ring from a process of its own
            from simulations.module_task import make_task
            from simulations.silo_engine import ConcurrentGrid, silo_client_app

            grid = ConcurrentGrid(silo_client_app(make_task, spec_from_run_config), clients,
                                  pki=pki)
        else:
            from simulations.engine_config import EngineConfig

            settings = EngineConfig(**config.get("engine", {}))
            grid = InProcessGrid(client_app, clients, pki=pki,
                                 cohort_hook=cohort_hook(settings.vectorize),
                                 node_cache=settings.node_cache_bound,
                                 threads=settings.threads)
        try:
            server_app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                     state=RecordDict(), run_config={"db": db}))
        finally:
            grid.close()  # the node states spilled to disk
    elif engine == "flower":
        from simulations.engine_config import EngineConfig
        from simulations.flower_engine import run_on_ray

        run_on_ray(server_app, client_app, num_supernodes=clients,
                   engine=engine_on(device, EngineConfig(**config.get("engine", {}))), pki=pki)
    else:
        raise ValueError(f"unknown engine '{engine}'; choose one of: {', '.join(ENGINES)}")
    if not result:
        raise RuntimeError(f"the {engine} engine finished without a result; see its log above")
    return result


def _stored_config(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration a run to resume was started with (it cannot change on resume)."""
    from server.store import Store

    changed = [flag for flag, value in (("--clients", args.clients), ("--rounds", args.rounds),
                                        ("--seed", args.seed), ("--set", args.set),
                                        ("--name", args.name))
               if value is not None and value != []] + \
        (["--scenario"] if args.scenario != "default" else [])
    if changed:
        raise ValueError(f"--resume continues a run with its stored configuration and name; "
                         f"drop {', '.join(changed)}")
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
    summary = {**summary, "engine": args.engine, "name": config["name"],
               "scenario": config.get("scenario", config["name"]),
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
    from rich.table import Table
    from rich.text import Text

    from server.store import Store
    from simulations.report import RUN_COLUMNS, run_row

    with Store(args.db, create=False) as store:
        runs = [run_row(r) for r in store.list_runs()]
    if args.json:
        print(json.dumps(runs))
        return 0

    def table_of(differs_width: int | None) -> Table:
        """The runs; "differs" ``differs_width`` wide, wrapped between its parts (None: left
        out), so every change shows whole."""
        columns = [c for c in RUN_COLUMNS if c != "differs" or differs_width is not None]
        table = Table(title=f"runs in {args.db}", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
                      show_edge=False)
        for col in columns:  # ids and dates are never cut, a name wraps if it must
            if col == "differs":
                table.add_column(col, width=differs_width, overflow="fold")
            else:
                table.add_column(col, no_wrap=col != "name", overflow="fold")
        for r in runs:
            cells = {**{c: _fmt(r[c]) for c in columns}, "created": r["created"][:16]}
            table.add_row(*(cells[c] for c in columns))
        return table

    console = _stdout_console()
    longest = max((len(r["differs"]) for r in runs), default=0)
    room = console.width - _width(table_of(None)) - 2  # its padding and rule
    if not longest or room >= MIN_DIFFERS_WIDTH:
        console.print(table_of(min(max(longest, len("differs")), room) if longest else None))
        return 0
    console.print(table_of(None))  # too narrow for a column: each run's changes below
    console.print("what each run changed from its scenario:")
    for r in runs:
        if r["differs"]:
            console.print(Text(f"{r['run']}  {r['differs']}"), overflow="fold")
    return 0


def _newest_run(store: Any, db: str) -> str:
    """The id of the run created last in ``store``."""
    runs = store.list_runs()  # newest first
    if not runs:
        raise ValueError(f"no runs in {db} yet: start one with `fedring simulate`")
    return runs[0].run_id


def cmd_report(args: argparse.Namespace) -> int:
    from server.store import Store
    from simulations.report import (
        audit_line,
        plot_run,
        privacy_summary,
        report_json,
        round_table,
        update_rows,
    )

    if args.round is not None and not args.updates:
        raise ValueError("--round picks the round whose updates to show: add --updates")
    with Store(args.db, create=False) as store:
        if args.run_id == LAST_RUN:
            args.run_id = _newest_run(store, args.db)
        info = store.get_run(args.run_id)
        rounds = store.rounds(args.run_id)
        rows = round_table(rounds, store.secagg_rounds(args.run_id))
        privacy = privacy_summary(store.privacy_ledger(args.run_id))
        updates = None
        if args.updates:
            recorded = [r.round for r in rounds]
            if args.round is not None and args.round not in recorded:
                held = f"rounds {recorded[0]} to {recorded[-1]}" if recorded else "no rounds"
                raise ValueError(f"run {args.run_id} has no round {args.round}: it has {held}")
            updates = update_rows(store.updates(args.run_id, round=args.round))
        path = None if args.json or args.updates else plot_run(store, args.run_id,
                                                                Path(args.out))
    if args.json:
        print(json.dumps(report_json(info, rows, privacy, updates), default=str))
        return 0
    console = _stdout_console()
    title = f"run {info.run_id} ({info.name}, {info.status})"
    if updates is not None:
        _print_updates(console, title, updates, args.round)
        return 0
    _print_rounds(console, title, rows, wide=args.wide)
    if privacy is not None:
        console.print(privacy)
    if audit_line(info.summary) is not None:
        console.print(audit_line(info.summary))
    if info.summary and info.summary.get("stop_reason"):
        console.print(info.summary["stop_reason"])
    console.print(f"plot: {path}")
    return 0


def _print_rounds(console: Any, title: str, rows: list[dict[str, object]], *,
                  wide: bool) -> None:
    """The round table in the console's width: without ``wide`` the essential columns, less
    those :func:`fit_columns` drops; what still does not fit (every column with ``wide``)
    goes on in further tables, each starting with the round, so no figure is cut."""
    from rich import box
    from rich.table import Table

    from simulations.report import HEADERS, column_groups, fit_columns, report_columns

    def table_of(columns: list[str], titled: bool = True) -> Table:
        table = Table(title=title if titled else None, box=box.SIMPLE_HEAD,
                      padding=(0, 1, 0, 0), show_edge=False)
        for col in columns:
            table.add_column(HEADERS.get(col, col), no_wrap=True)
        for row in rows:  # blank where a round has no such figure (e.g. no evaluation)
            table.add_row(*(_fmt(row.get(c)) for c in columns))
        return table

    def width_of(columns: list[str]) -> int:  # what table_of(columns) takes, unrendered
        return sum(_column_width(HEADERS.get(c, c), (_fmt(row.get(c)) for row in rows)) + 2
                   for c in columns) - 1  # each: its padding and the rule, less the last

    columns = report_columns(rows, wide=wide)
    if not wide:
        columns = fit_columns(columns, rows, width_of, console.width)
    for i, group in enumerate(column_groups(columns, width_of, console.width)):
        if i:
            console.print()
        console.print(table_of(group, titled=not i))
    if not wide:
        console.print("more columns (version, sampled, secure rounds' k/t, survivors and "
                      "security, bytes, train loss, the clients' accuracy spread, ...): --wide")


def _print_updates(console: Any, title: str, updates: list[dict[str, Any]],
                   rnd: int | None) -> None:
    """Each update's round, client, fate, weight, norm, staleness and reason. The reason
    wraps, never cut: in its column where the others leave it room, else on indented
    lines below a line of the other fields (a console too narrow for the table)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from simulations.report import UPDATE_COLUMNS

    where = f"round {rnd} of {title}" if rnd is not None else title
    if not updates:
        console.print(f"no updates recorded in {where}")
        return

    def table_of(columns: tuple[str, ...]) -> Table:
        table = Table(title=f"updates in {where}", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
                      show_edge=False)
        for col in columns:
            table.add_column(col, no_wrap=col != "reason", overflow="fold")
        for row in updates:
            table.add_row(*(Text(_fmt(row.get(c))) for c in columns))  # no markup
        return table

    fields = UPDATE_COLUMNS[:-1]
    if _width(table_of(fields)) + 1 + MIN_REASON_WIDTH <= console.width:
        console.print(table_of(UPDATE_COLUMNS))
        return
    console.print(f"updates in {where}", markup=False, highlight=False)
    for row in updates:
        console.print("  ".join(f"{c} {_fmt(row[c])}" if c != "fate" else row[c]
                                for c in fields if row.get(c) is not None),
                      markup=False, highlight=False)
        if row.get("reason"):
            console.print(textwrap.fill(row["reason"], console.width, initial_indent="    ",
                                        subsequent_indent="    ", break_on_hyphens=False),
                          markup=False, highlight=False)


def _stdout_console() -> Any:
    """A rich console on stdout that leaves a closed stdout to :func:`main` (rich would exit
    1 on its own), so that every command ends the same way."""
    from rich.console import Console

    def closed() -> None:
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout is gone")

    console = Console()
    console.on_broken_pipe = closed
    return console


def _column_width(header: str, cells: Any) -> int:
    """The width of a table column that never wraps: its widest header line or cell."""
    from rich.cells import cell_len

    return max(cell_len(text) for text in (*header.split("\n"), *cells))


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
    parser.add_argument("--debug", action="store_true",
                        help="show the whole traceback of an error (before the command: "
                             "fedring --debug simulate ...)")
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
                     help="continue a run from its last checkpoint (same --db; it keeps "
                          "its name)")
    sim.add_argument("--name", help="the run's name in `fedring runs` (default: the "
                                    "scenario's top-level name, else its file name)")
    sim.set_defaults(func=cmd_simulate)

    runs = sub.add_parser("runs", help="list runs in the store")
    runs.add_argument("--db", default=DEFAULT_DB)
    runs.add_argument("--json", action="store_true", help="print the runs as one JSON list")
    runs.set_defaults(func=cmd_runs)

    rep = sub.add_parser("report", help="a run's rounds (table and plot) and updates")
    rep.add_argument("run_id", help=f"a run id from `fedring runs`, or {LAST_RUN} for the "
                                    "newest run")
    rep.add_argument("--db", default=DEFAULT_DB, help="SQLAlchemy URL of the run store")
    rep.add_argument("--out", default="runs", help="directory for the PNG plot")
    rep.add_argument("--wide", action="store_true",
                     help="every column, not only the essential (more tables where they "
                          "do not fit in one)")
    rep.add_argument("--json", action="store_true",
                     help="print the run and its rounds as one JSON object (no plot)")
    rep.add_argument("--updates", action="store_true",
                     help="each update's client, fate, weight, norm, staleness and the "
                          "reason it was rejected or dropped (in --json: \"updates\")")
    rep.add_argument("--round", type=int, metavar="R",
                     help="with --updates: only round R's updates")
    rep.set_defaults(func=cmd_report)

    from simulations.deploy import add_parsers as add_deploy_parsers

    add_deploy_parsers(sub)  # deploy up/down, certs

    from simulations.silo_cli import add_parser as add_silo_parser

    add_silo_parser(sub)  # silo: a torchrun job as one Flower client
    parser.description = f"Federated learning on Flower; commands: {', '.join(sub.choices)}."
    return parser


def _task_code_error() -> type[Exception]:
    """The error of a failing function of a user's task module (``TaskCodeError``), looked
    up only once something failed: none can be raised before that module is imported."""
    module = sys.modules.get("simulations.module_task")
    return module.TaskCodeError if module is not None else _NeverRaised


class _NeverRaised(Exception):
    """Matches no error (no task module was imported)."""


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            return int(args.func(args))
        except _task_code_error() as exc:  # the user's own code failed: one line, logged
            logging.getLogger("fedring").error("%s", exc, exc_info=exc)
            if args.debug:
                raise
            print(f"fedring: error: {exc}", file=sys.stderr)
            return 1
        except (ValueError, LookupError) as exc:
            if args.debug:
                raise
            print(f"fedring: error: {exc}", file=sys.stderr)
            return 2
        finally:
            sys.stdout.flush()  # a reader gone before the end shows here, not at exit
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """Stop quietly once the reader of stdout is gone (``fedring report --json | head``):
    what is left to print goes nowhere, and the exit status is a pipe writer's on SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
