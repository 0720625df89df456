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

    def privacy_figures(self, relations: dict[str, str], against: dict[str, str]) -> None:
        """The run's privacy figures, by key: each one's neighbouring relation and whom it
        protects against (sent once, after ``run_started``, by a DP run)."""

    def message(self, text: str) -> None: ...

    def run_finished(self, summary: dict[str, Any]) -> None: ...


PRIVACY_FIGURES = ("epsilon", "epsilon_replace_one", "epsilon_model")


def federated_text(figures: dict[str, Any]) -> str:
    """``fed acc 0.912 (p10 0.80, min 0.71)``, with ``personal acc ...`` beside it where the
    clients' own models were measured; "" when the figures hold no federated evaluation
    (a round's metrics or a run summary)."""
    from server.spread import accuracy_key

    parts = []
    for personal, name in ((False, "fed acc"), (True, "personal acc")):
        value = figures.get(accuracy_key(personal=personal))
        if value is None:
            continue
        spread = ", ".join(f"{stat} {figures[key]:.2f}" for stat in ("p10", "min")
                           if (key := accuracy_key(stat, personal=personal)) in figures
                           and figures[key] is not None)
        parts.append(f"{name} {value:.3f}" + (f" ({spread})" if spread else ""))
    return ", ".join(parts)


def figure_text(key: str, value: float, relations: dict[str, str]) -> str:
    """``epsilon 9.01 (zero-out)``: a privacy figure with its relation, when known."""
    relation = relations.get(key)
    return f"{key} {value:.4g}" + (f" ({relation})" if relation else "")


def figures_line(relations: dict[str, str], against: dict[str, str]) -> str:
    """The line that names a DP run's figures before its first round."""
    return "privacy figures: " + "; ".join(
        f"{key} against the {against[key]} ({relations[key]})" for key in relations)


def noise_text(metrics: dict[str, float]) -> str:
    """``n/s 1.23``: central DP's noise norm over the mean clipped update's, where the round
    recorded it; else ""."""
    value = metrics.get("noise_to_signal")
    return "" if value is None else f"n/s {value:.3g}"


def round_line(rnd: int, rounds: int | None, metrics: dict[str, float],
               relations: dict[str, str] | None = None) -> str:
    """One line on a finished round: accuracy, loss, the updates' fates, the privacy
    figures with their relations where DP is on, central DP's noise to signal before them
    (:func:`noise_text`), and a secure round's outcome
    (``secure_survivors``, ``secure_aborted``); on a round that evaluated on the clients,
    their accuracy with its 10th percentile and minimum (:func:`federated_text`)."""
    parts = [f"{key} {metrics[key]:.4f}" for key in ("accuracy", "loss") if key in metrics]
    parts.append(", ".join(f"{int(metrics.get(fate, 0))} {fate}"
                           for fate in ("accepted", "rejected", "dropped")))
    if federated := federated_text(metrics):
        parts.append(federated)
    if noise := noise_text(metrics):
        parts.append(noise)
    for key in PRIVACY_FIGURES:
        if key in metrics:
            parts.append(figure_text(key, metrics[key], relations or {}))
    if metrics.get("secure_aborted"):
        parts.append("secure round aborted")
    elif "secure_survivors" in metrics:
        parts.append(f"secure sum of {int(metrics['secure_survivors'])} survivors")
    if metrics.get("secagg_clipped"):  # values the clients clipped, from the secure sum
        parts.append(f"{int(metrics['secagg_clipped'])} values clipped "
                     f"({metrics.get('secagg_clipped_fraction', 0.0):.2%} of coordinates)")
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
    if federated := federated_text(summary):
        line += f", {federated}"
    for key in PRIVACY_FIGURES:
        if summary.get(key) is not None:
            line += ", " + figure_text(key, summary[key], summary_relations(summary))
    line += f", store {summary.get('store')}"
    if summary.get("dp_sgd_epsilon") is not None:
        line += (f"; dp_sgd_epsilon {summary['dp_sgd_epsilon']:.4g} at delta "
                 f"{summary['dp_sgd_delta']:g} ({summary['dp_sgd_relation']}, the largest "
                 f"over clients): protects {summary['dp_sgd_protects']} against "
                 f"{summary['dp_sgd_protects_against']}")
    return line + (f"; {summary['stop_reason']}" if summary.get("stop_reason") else "")


def summary_relations(summary: dict[str, Any]) -> dict[str, str]:
    """Each privacy figure's relation, as a run summary states it."""
    out = {"epsilon": summary.get("relation"), "epsilon_replace_one": "replace-one",
           "epsilon_model": summary.get("relation_model")}
    return {key: value for key, value in out.items() if value}


class LogReporter(Reporter):
    """Prints one line per round and the final status to stdout, which Flower streams
    (``flwr run . --stream``) and the ``fedring`` logger records."""

    def __init__(self) -> None:
        self._rounds: int | None = None
        self._relations: dict[str, str] = {}

    @staticmethod
    def _print(text: str, level: int = logging.INFO) -> None:
        print(text, flush=True)
        log.log(level, "%s", text)

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        self._rounds = config.get("federation", {}).get("rounds")
        self._print(f"fedring run {run_id} started")

    def privacy_figures(self, relations: dict[str, str], against: dict[str, str]) -> None:
        self._relations = dict(relations)
        self._print(figures_line(relations, against))

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        self._print(round_line(rnd, self._rounds, metrics, self._relations))

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

    def privacy_figures(self, relations: dict[str, str], against: dict[str, str]) -> None:
        for r in self.reporters:
            r.privacy_figures(relations, against)

    def message(self, text: str) -> None:
        for r in self.reporters:
            r.message(text)

    def run_finished(self, summary: dict[str, Any]) -> None:
        for r in self.reporters:
            r.run_finished(summary)
