"""``[tracking]``: each run's rounds in TensorBoard and MLflow, beside the store.

A ``TrackingReporter`` observes the run loop like any reporter (``server.reporter``), so it
works on every engine and under ``flwr run``, and talks to the sinks on a thread of its own.
Both sinks are optional extras (``pip install 'fedring[tracking]'``) and off by default; a
sink that fails is logged once and dropped for the rest of the run, which goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.reporter import Reporter, figures_line
from server.spread import accuracy_key

log = logging.getLogger("fedring")
EXTRA = "pip install 'fedring[tracking]'"
RUN_ID_TAG = "fedring.run_id"
FINISH_TIMEOUT_S = 60.0  # how long the end of a run waits for tracking to catch up
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


@dataclass(frozen=True)
class TrackingConfig:
    """Where to track runs: a TensorBoard log directory (one subdirectory per run) and an
    MLflow tracking URI (a tracking server URL, ``sqlite:///...``, or a local file store:
    a path or ``file:/...``) with the experiment to log to. Empty: off."""

    tensorboard: str = ""
    mlflow: str = ""
    experiment: str = "fedring"

    def __post_init__(self) -> None:
        if self.mlflow and not self.experiment:
            raise ValueError("tracking.experiment must name the MLflow experiment")

    def require(self) -> None:
        """Fail at start when a configured sink's package is not installed."""
        for key, module, what in (("tensorboard", "tensorboard", "TensorBoard"),
                                  ("mlflow", "mlflow", "MLflow")):
            if getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ValueError(f"tracking.{key} needs {what}, which is not installed: "
                                 f"{EXTRA} (or remove tracking.{key})")


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(section.key, value)`` for every leaf of a nested config."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric figures of a round (bools and strings left out)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def spread_layout(metrics: Mapping[str, float]) -> dict[str, dict[str, list[Any]]]:
    """TensorBoard's custom-scalars layout of a federated evaluation's figures: a margin
    chart per model (the clients' mean accuracy in its 10th-90th percentile band) and the
    weighted, minimum and central accuracies on one chart."""
    charts: dict[str, list[Any]] = {}
    for personal, name in ((False, "global model"), (True, "personal models")):
        if accuracy_key(personal=personal) not in metrics:
            continue
        if accuracy_key("p10", personal=personal) in metrics:  # none: secure evaluation
            charts[f"clients' accuracy, {name}: mean, 10th-90th percentile"] = [
                "Margin", [accuracy_key(stat, personal=personal)
                           for stat in ("mean", "p10", "p90")]]
        charts[f"weighted, minimum and central accuracy, {name}"] = [
            "Multiline", [f"^{re.escape(tag)}$" for tag in  # tags are regular expressions
                          (accuracy_key(personal=personal),
                           accuracy_key("min", personal=personal), "accuracy")]]
    return {"federated evaluation": charts}


class TensorBoardSink:
    """One event-file run per fedring run, in ``<dir>/<run_id>``: every round figure as a
    scalar under its store name (``federated_accuracy_p10``, ...), and once a round has
    evaluated on the clients, a custom-scalars layout that charts their spread."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self.spread_shown = False  # the custom-scalars layout of the clients' spread

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir / run_id))
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        # Indented: Markdown shows it as a code block.
        self.writer.add_text("config", "\n".join(f"    {line}" for line in text.splitlines()))
        self.writer.flush()

    def figures(self, relations: Mapping[str, str], against: Mapping[str, str]) -> None:
        """Each privacy figure's party and relation, as the text ``privacy_figures``."""
        self.writer.add_text("privacy_figures", figures_line(dict(relations), dict(against)))
        self.writer.flush()

    def round(self, rnd: int, metrics: Mapping[str, float]) -> None:
        if not self.spread_shown and accuracy_key() in metrics:
            self.writer.add_custom_scalars(spread_layout(metrics))
            self.spread_shown = True
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=rnd)
        self.writer.flush()  # a run that dies keeps what it reported

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.writer.close()


class MlflowSink:
    """An MLflow run per fedring run (resumed runs continue theirs): the flattened config
    as params, per-round metrics with the round as step, the report plot as an artifact,
    and the fedring run id as the tag ``fedring.run_id``."""

    def __init__(self, uri: str, experiment: str, store_url: str) -> None:
        self.uri = uri if _SCHEME.match(uri) else Path(uri).resolve().as_uri()
        self.experiment = experiment
        self.store_url = store_url
        self.client: Any = None
        self.run_id = ""  # MLflow's
        self.fedring_run_id = ""

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        if self.uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless told;
            # the config asked for one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.fedring_run_id = run_id
        experiment_id = self._experiment_id()
        found = self.client.search_runs([experiment_id],
                                        filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                                        max_results=1)
        if found:  # a resumed fedring run: continue its MLflow run, params already there
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(experiment_id, run_name=run_id,
                                     tags={RUN_ID_TAG: run_id,
                                           "fedring.name": str(config.get("name", "")),
                                           "fedring.scenario": str(config.get(
                                               "scenario", config.get("name", "")))})
        self.run_id = run.info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flatten(config)]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment)
        except Exception:  # created meanwhile by another run
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def figures(self, relations: Mapping[str, str], against: Mapping[str, str]) -> None:
        """Each privacy figure's relation and party as tags, e.g.
        ``fedring.relation.epsilon = zero-out``, ``fedring.against.epsilon = server``."""
        for key, relation in relations.items():
            self.client.set_tag(self.run_id, f"fedring.relation.{key}", relation)
            self.client.set_tag(self.run_id, f"fedring.against.{key}", against[key])

    def round(self, rnd: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, rnd) for key, value in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def finish(self, summary: Mapping[str, Any]) -> None:
        from server.store import Store
        from simulations.report import plot_run

        status = summary.get("status", "completed")
        self.client.set_tag(self.run_id, "fedring.status", status)
        try:
            with tempfile.TemporaryDirectory() as tmp, Store(self.store_url) as store:
                self.client.log_artifact(self.run_id,
                                         str(plot_run(store, self.fedring_run_id, Path(tmp))))
        finally:
            self.client.set_terminated(self.run_id,
                                       status="FAILED" if status == "failed" else "FINISHED")


class TrackingReporter(Reporter):
    """Sends each round's figures to the configured sinks on a thread of its own, so a
    slow or unreachable tracking server never holds up training; a sink that raises is
    logged once and dropped, never failing the run. The run's end waits for the sinks at
    most ``FINISH_TIMEOUT_S``."""

    def __init__(self, sinks: dict[str, Any]) -> None:
        self.sinks = dict(sinks)
        self._calls: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self._worker: threading.Thread | None = threading.Thread(
            target=self._work, name="fedring-tracking", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            self._each(*call)

    def _each(self, method: str, args: tuple[Any, ...]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:
                del self.sinks[name]
                log.warning("tracking to %s failed and stops for this run (training goes "
                            "on): %s: %s", name, type(exc).__name__, exc)

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        self._calls.put(("start", (run_id, config)))

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        self._calls.put(("round", (rnd, scalars(metrics))))

    def privacy_figures(self, relations: dict[str, str], against: dict[str, str]) -> None:
        self._calls.put(("figures", (dict(relations), dict(against))))

    def run_finished(self, summary: dict[str, Any]) -> None:
        if self._worker is None:  # already finished
            return
        self._calls.put(("finish", (dict(summary),)))
        self._calls.put(None)
        self._worker.join(FINISH_TIMEOUT_S)
        if self._worker.is_alive():
            log.warning("tracking to %s did not finish within %g s; what it had not sent "
                        "yet is dropped", ", ".join(list(self.sinks)), FINISH_TIMEOUT_S)
        self._worker = None


def open_tracking(config: Mapping[str, Any], store_url: str) -> TrackingReporter | None:
    """The reporter ``[tracking]`` asks for, None when it asks for none; fails (before the
    run starts) when a sink's package is missing."""
    tracking = TrackingConfig(**config.get("tracking", {}))
    tracking.require()
    sinks: dict[str, Any] = {}
    if tracking.tensorboard:
        sinks[f"TensorBoard ({tracking.tensorboard})"] = TensorBoardSink(tracking.tensorboard)
    if tracking.mlflow:
        sinks[f"MLflow ({tracking.mlflow})"] = MlflowSink(tracking.mlflow, tracking.experiment,
                                                          store_url)
    return TrackingReporter(sinks) if sinks else None
