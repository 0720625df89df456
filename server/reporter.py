"""Progress hooks a round driver calls; the CLI shows them live, the default prints them."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("fedring")
log.addHandler(logging.NullHandler())  # printed by LogReporter; logged for who configures it


class Reporter:
    """No-op base: override what you want to show."""

    def run_started(self, run_id: str, config: dict[str, Any]) -> None: ...

    def round_started(self, rnd: int, sampled: int) -> None: ...

    def client_done(self, rnd: int, done: int, sampled: int) -> None: ...

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None: ...

    def message(self, text: str) -> None: ...

    def run_finished(self, summary: dict[str, Any]) -> None: ...


def round_line(rnd: int, rounds: int | None, metrics: dict[str, float]) -> str:
    """One line on a finished round: accuracy, loss, the updates' fates, epsilon where DP
    is on, and a secure round's outcome (``secure_survivors``, ``secure_aborted``)."""
    parts = [f"{key} {metrics[key]:.4f}" for key in ("accuracy", "loss") if key in metrics]
    parts.append(", ".join(f"{int(metrics.get(fate, 0))} {fate}"
                           for fate in ("accepted", "rejected", "dropped")))
    for key in ("epsilon", "epsilon_model"):
        if key in metrics:
            parts.append(f"{key} {metrics[key]:.4g}")
    if metrics.get("secure_aborted"):
        parts.append("secure round aborted")
    elif "secure_survivors" in metrics:
        parts.append(f"secure sum of {int(metrics['secure_survivors'])} survivors")
    if "dp_sgd_epsilon" in metrics:  # the largest client's, composed over its rounds
        parts.append(f"dp_sgd_epsilon {metrics['dp_sgd_epsilon']:.4g} (sample-level)")
    of = f"/{rounds}" if rounds else ""
    return f"round {rnd}{of}: " + ", ".join(parts)


def status_line(summary: dict[str, Any]) -> str:
    """The run's final status, one line (the last one under ``flwr run``)."""
    line = (f"fedring run {summary.get('run_id')}: {summary.get('status')} after "
            f"{summary.get('rounds')} rounds")
    if summary.get("final_accuracy") is not None:
        line += f", accuracy {summary['final_accuracy']:.4f}"
    if summary.get("epsilon") is not None:
        line += f", epsilon {summary['epsilon']:.4g}"
    line += f", store {summary.get('store')}"
    if summary.get("dp_sgd_epsilon") is not None:
        line += (f"; dp_sgd_epsilon {summary['dp_sgd_epsilon']:.4g} at delta "
                 f"{summary['dp_sgd_delta']:g} ({summary['dp_sgd_relation']}, the largest "
                 f"over clients): protects {summary['dp_sgd_protects']} against "
                 f"{summary['dp_sgd_protects_against']}")
    return line + (f"; {summary['stop_reason']}" if summary.get("stop_reason") else "")
    if metrics.get("secagg_clipped"):  # values the clients clipped, from the secure sum
        parts.append(f"{int(metrics['secagg_clipped'])} values clipped "
                     f"({metrics.get('secagg_clipped_fraction', 0.0):.2%} of coordinates)")


class LogReporter(Reporter):
    """Prints one line per round and the final status to stdout, which Flower streams
    (``flwr run . --stream``) and the ``fedring`` logger records."""

    def __init__(self) -> None:
        self._rounds: int | None = None

    @staticmethod
    def _print(text: str, level: int = logging.INFO) -> None:
        print(text, flush=True)
        log.log(level, "%s", text)

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        self._rounds = config.get("federation", {}).get("rounds")
        self._print(f"fedring run {run_id} started")

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        self._print(round_line(rnd, self._rounds, metrics))

    def message(self, text: str) -> None:
        self._print(text, logging.WARNING)

    def run_finished(self, summary: dict[str, Any]) -> None:
        self._print(status_line(summary))


class Reporters(Reporter):
    """Several reporters as one (e.g. the progress display and experiment tracking): each
    hook goes to every reporter in turn."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        for r in self.reporters:
            r.run_started(run_id, config)

    def round_started(self, rnd: int, sampled: int) -> None:
        for r in self.reporters:
            r.round_started(rnd, sampled)

    def client_done(self, rnd: int, done: int, sampled: int) -> None:
        for r in self.reporters:
            r.client_done(rnd, done, sampled)

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        for r in self.reporters:
            r.round_finished(rnd, metrics)

    def message(self, text: str) -> None:
        for r in self.reporters:
            r.message(text)

    def run_finished(self, summary: dict[str, Any]) -> None:
        for r in self.reporters:
            r.run_finished(summary)
