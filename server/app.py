"""fedring's ServerApp: resolve the scenario, build the pipeline, drive rounds over the Grid.

The task (model and held-out data) and the scenario resolver are injected, so this
module knows nothing about datasets; ``simulations.apps`` binds the concrete ones.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Mapping, Sized
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from aggregation.pipeline import PreCombine
from server.audit import make_audit
from server.clock import Clock
from server.config import FederationConfig
from server.dp import dp_controller
from server.drivers import driver
from server.reporter import LogReporter, Reporter, Reporters
from server.rounds import RoundSource, RunContext, wait_for_nodes
from server.run_loop import RunLoop
from server.scenario import ServerScenario
from server.secagg_config import exposure_warning
from server.secure_aggregation import SecureAggregation, make_secure_aggregation
from server.settings_checks import check_settings
from server.store import Store, absolute_url, mask_url
from server.task import ServerTask

DEFAULT_DB = "sqlite:///runs/fedring.db"
NODES_KEY = "connected-nodes"  # what the ServerApp adds to the run config it resolves

ConfigResolver = Callable[[Mapping[str, Any]], dict[str, Any]]
TaskBuilder = Callable[[dict[str, Any]], ServerTask]
ClockFactory = Callable[[dict[str, Any]], Clock]
# An observer of a run built from its resolved config and store URL (e.g. experiment
# tracking), None when the config asks for none; it may refuse the config before the run.
ObserverFactory = Callable[[dict[str, Any], str], Reporter | None]
PreCombineFactory = Callable[[dict[str, Any]], PreCombine | None]


def run_server(grid: Grid, config: dict[str, Any], *, task: ServerTask, store_url: str,
               reporter: Reporter | None = None, clock: Clock | None = None,
               resume: str | None = None,
               pre_combine: PreCombine | None = None) -> dict[str, Any]:
    """Run one federated training job over ``grid``; returns the run summary.

    With ``resume`` (a run id in the store) the run continues from its last checkpoint.

    ``[driver] kind`` names the driver (``server.drivers``), which builds the run's round
    source (sync, FedAsync, FedBuff, cross-silo, gossip or one registered later) that
    ``server.run_loop.RunLoop`` drives; ``clock`` is a simulated clock in simulations,
    else the wall clock is used. ``pre_combine`` may
    rewrite each sync round's updates before they are aggregated
    (``aggregation.pipeline.Pipeline``; the simulations' omniscient attackers).
    """
    scenario = ServerScenario.of(config)  # the typed sections, parsed once
    check_settings(scenario)  # a configuration made by hand is refused before any round too
    dp = dp_controller(scenario.dp, scenario.federation) if scenario.dp.enabled else None
    audit = make_audit(scenario, dp)  # None without [audit]: no canary enters the run
    pipeline = scenario.aggregation.build(dp.stages() if dp is not None else ([], []),
                                          staleness=scenario.driver.staleness_config(),
                                          canaries=audit, seed=scenario.seed,
                                          secure=scenario.secagg.enabled,
                                          pre_combine=pre_combine)
    secure = make_secure_aggregation(scenario)  # None unless [secagg] is enabled
    store = Store(store_url)
    try:
        ctx = RunContext(grid, scenario=scenario, task=task, pipeline=pipeline, store=store,
                         reporter=reporter or LogReporter(), dp=dp, clock=clock)
        if (weak_secagg := exposure_warning(config)) is not None:
            ctx.reporter.message(weak_secagg)  # once, at start: Bell et al.'s bound missed
        loop = RunLoop(ctx, round_source(ctx, secure=secure), audit=audit)
        return loop.resume(resume) if resume else loop.run()
    finally:
        store.close()


def round_source(ctx: RunContext, *, secure: SecureAggregation | None) -> RoundSource:
    """The round source that the driver ``[driver] kind`` names builds for this run,
    secure when ``secure`` is given."""
    return driver(ctx.driver_config.kind).build(ctx, secure)


def make_server_app(build_task: TaskBuilder, resolve_config: ConfigResolver, *,
                    config: dict[str, Any] | None = None, store_url: str | None = None,
                    reporter: Reporter | None = None,
                    on_summary: Callable[[dict[str, Any]], None] | None = None,
                    clock: ClockFactory | None = None, resume: str | None = None,
                    observe: ObserverFactory | None = None,
                    pre_combine: PreCombineFactory | None = None) -> ServerApp:
    """A Flower ServerApp for a fixed ``config``, or one resolved from the run config.

    Under ``flwr run`` the run config gives ``scenario`` (a name or TOML path), ``db``
    (a SQLAlchemy URL), ``overrides`` and ``resume`` (a run id to continue); unless the run
    config sets ``federation.clients``, it is the number of connected nodes (passed to
    ``resolve_config`` as ``NODES_KEY``). A bad run config prints its message and no
    traceback. ``clock`` builds a simulated clock from the resolved config (simulations);
    without it the wall clock is used.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        shown = reporter or LogReporter()
        if config is not None:  # resolved, checked and reported by the caller
            cfg, url, resume_id = config, store_url or DEFAULT_DB, resume
            task = build_task(cfg)
        else:
            try:
                cfg, url, resume_id = _from_run_config(grid, dict(context.run_config),
                                                       resolve_config, store_url, resume)
                task = build_task(cfg)
                Store(url).close()  # an unusable store fails here, in one line
            except (ValueError, LookupError, RuntimeError) as exc:
                shown.message(f"fedring: error: {exc}")
                shown.message("fedring run not started: fix the run config and submit it "
                              "again")
                return
            shown.message(f"fedring: {node_count(grid)} node(s) connected, "
                          f"federation.clients = {cfg['federation']['clients']}, store {url}")
        warn_on_node_count(grid, cfg, shown)
        observer = observe(cfg, url) if observe is not None else None
        try:
            summary = run_server(grid, cfg, task=task, store_url=url, resume=resume_id,
                                 reporter=Reporters(shown, observer) if observer else shown,
                                 clock=clock(cfg) if clock else None,
                                 pre_combine=pre_combine(cfg) if pre_combine else None)
        except Exception as exc:
            if observer is not None:
                observer.run_finished({"status": "failed"})
            if config is not None:
                raise
            # Under flwr run the status is the stream's last line (Flower exits 0 anyway).
            traceback.print_exc(file=sys.stdout)
            shown.message(f"fedring run failed: {type(exc).__name__}: {exc} (stored as "
                          f"failed in {mask_url(url)})")
            return
        if on_summary is not None:
            on_summary(summary)

    return app


def _from_run_config(grid: Grid, run_config: dict[str, Any], resolve_config: ConfigResolver,
                     store_url: str | None,
                     resume: str | None) -> tuple[dict[str, Any], str, str | None]:
    """The resolved config, the store's absolute URL and the run to resume, from a run
    config; ``federation.clients`` is the number of connected nodes unless it is set."""
    url = absolute_url(store_url or str(run_config.get("db") or DEFAULT_DB))
    resume_id = resume or str(run_config.get("resume", "")) or None
    if resume_id:  # a resumed run keeps the configuration it was started with
        with Store(url, create=False) as store:
            return store.get_run(resume_id).config, url, resume_id
    first = resolve_config(run_config)
    nodes = wait_for_nodes(grid, FederationConfig(**first["federation"]))
    return resolve_config({**run_config, NODES_KEY: len(nodes)}), url, None


def node_count(grid: Grid) -> int:
    """How many nodes the grid has, without listing them when it can say (a range)."""
    ids = grid.get_node_ids()
    return len(ids) if isinstance(ids, Sized) else len(list(ids))


def warn_on_node_count(grid: Grid, config: dict[str, Any], reporter: Reporter) -> None:
    """Say loudly when ``federation.clients`` differs from the number of connected nodes:
    partitions without a node never train, nodes without a partition fail."""
    nodes, clients = node_count(grid), config["federation"]["clients"]
    if nodes == clients or nodes == 0:
        return
    effect = (f"only {nodes} of the {clients} partitions will train" if nodes < clients
              else f"nodes with partition-id >= {clients} have no partition")
    reporter.message(f"WARNING: federation.clients is {clients} but {nodes} nodes are "
                     f"connected: {effect}; leave federation.clients unset under flwr run "
                     f"to use the nodes' count, or start {clients} nodes")
