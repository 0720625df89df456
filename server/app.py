"""fedring's ServerApp: resolve the scenario, build the pipeline, drive rounds over the Grid.

The task (model and held-out data) and the scenario resolver are injected, so this
module knows nothing about datasets; ``simulations.apps`` binds the concrete ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from privacy.dp import DPConfig
from server.async_driver import async_driver_class
from server.audit import make_audit
from server.clock import Clock
from server.config import AggregationConfig, FederationConfig
from server.dp import dp_controller
from server.reporter import LogReporter, Reporter
from server.secure_round import make_secure_rounds
from server.store import Store
from server.sync_driver import SyncDriver
from server.task import ServerTask

DEFAULT_DB = "sqlite:///runs/fedring.db"

ConfigResolver = Callable[[Mapping[str, Any]], dict[str, Any]]
TaskBuilder = Callable[[dict[str, Any]], ServerTask]
ClockFactory = Callable[[dict[str, Any]], Clock]


def run_server(grid: Grid, config: dict[str, Any], *, task: ServerTask, store_url: str,
               reporter: Reporter | None = None, clock: Clock | None = None,
               resume: str | None = None) -> dict[str, Any]:
    """Run one federated training job over ``grid``; returns the run summary.

    With ``resume`` (a run id in the store) the run continues from its last checkpoint.

    The ``[driver]`` section picks the driver (sync, FedAsync, FedBuff or cross-silo); ``clock`` is
    a simulated clock in simulations, else the wall clock is used.
    """
    dp_config = DPConfig.from_dict(config.get("dp", {}))
    dp = (dp_controller(dp_config, FederationConfig(**config["federation"]))
          if dp_config.enabled else None)
    audit = make_audit(config, dp)  # None without [audit]: no canary enters the run
    pipeline = AggregationConfig(**config["aggregation"]).build(dp, canaries=audit)
    secure = make_secure_rounds(config)  # None unless [secagg] is enabled; refuses misfits
    store = Store(store_url)
    try:
        kind = config.get("driver", {}).get("kind", "sync")
        if kind == "cross_silo":  # the silos aggregate among themselves over a ring
            from server.cross_silo import CrossSiloDriver

            driver_cls: type = CrossSiloDriver
        else:
            driver_cls = SyncDriver if kind == "sync" else async_driver_class(kind)
        driver = driver_cls(grid, config=config, task=task, pipeline=pipeline, store=store,
                            reporter=reporter or LogReporter(), dp=dp, clock=clock)
        driver.secure = secure
        driver.audit = audit
        return driver.resume(resume) if resume else driver.run()
    finally:
        store.close()


def make_server_app(build_task: TaskBuilder, resolve_config: ConfigResolver, *,
                    config: dict[str, Any] | None = None, store_url: str | None = None,
                    reporter: Reporter | None = None,
                    on_summary: Callable[[dict[str, Any]], None] | None = None,
                    clock: ClockFactory | None = None, resume: str | None = None) -> ServerApp:
    """A Flower ServerApp for a fixed ``config``, or one resolved from the run config.

    Under ``flwr run`` the run config gives ``scenario`` (a name or TOML path), ``db``
    (a SQLAlchemy URL), ``overrides`` and ``resume`` (a run id to continue). ``clock``
    builds a simulated clock from the resolved config (simulations); without it the wall
    clock is used.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = dict(context.run_config)
        url = store_url or str(run_config.get("db", DEFAULT_DB))
        resume_id = resume or str(run_config.get("resume", "")) or None
        if config is not None:
            cfg = config
        elif resume_id:  # a resumed run keeps the configuration it was started with
            with Store(url) as store:
                cfg = store.get_run(resume_id).config
        else:
            cfg = resolve_config(run_config)
        summary = run_server(grid, cfg, task=build_task(cfg), store_url=url, resume=resume_id,
                             reporter=reporter, clock=clock(cfg) if clock else None)
        if on_summary is not None:
            on_summary(summary)

    return app
