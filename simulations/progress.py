"""A live progress display for the CLI: round, clients done, loss and accuracy."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from server.reporter import Reporter, federated_text, figures_line, log, noise_text

REFRESH_S = 0.1  # Rich redraws a live display 10 times a second


class RichReporter(Reporter):
    """Shows one bar for the rounds and one for the clients of the current round."""

    def __init__(self, rounds: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
            transient=False)
        self._rounds = self.progress.add_task("rounds", total=rounds, info="")
        self._clients = self.progress.add_task("clients", total=1, info="")
        self._shown = -math.inf  # when the clients' bar was last updated (monotonic)
        self._relation = ""  # epsilon's neighbouring relation, shown beside it
        self._federated: tuple[int, str] | None = None  # the last federated evaluation

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        self.progress.update(self._rounds, description=f"run {run_id}")

    def round_started(self, rnd: int, sampled: int) -> None:
        self.progress.update(self._clients, description=f"round {rnd}", total=sampled,
                             completed=0)

    def client_done(self, rnd: int, done: int, sampled: int) -> None:
        """The clients' bar, at most every ``REFRESH_S`` (the display's own rate) and at
        the last client: not a bar update for each of thousands of quick clients."""
        now = time.monotonic()
        if done >= sampled or now - self._shown >= REFRESH_S:
            self._shown = now
            self.progress.update(self._clients, completed=done)

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        info = (f"loss {metrics.get('loss', float('nan')):.4f}  "
                f"acc {metrics.get('accuracy', float('nan')):.4f}")
        if "epsilon" in metrics:  # privacy spent so far, after every round
            info += f"  eps {metrics['epsilon']:.3g} {self._relation}".rstrip()
        if noise := noise_text(metrics):  # central DP: noise norm over the mean update's
            info += f"  {noise}"
        if "dp_sgd_epsilon" in metrics:  # the largest client's DP-SGD figure (sample-level)
            info += f"  dp-sgd eps {metrics['dp_sgd_epsilon']:.3g}"
        if metrics.get("secagg_clipped"):  # values clipped under secure aggregation
            info += f"  clipped {int(metrics['secagg_clipped'])}"
        if federated := federated_text(metrics):  # a round that evaluated on the clients
            self._federated = (rnd, federated)
        if self._federated:  # the last evaluation stays in view, with its round once old
            at, federated = self._federated
            info += f"  {federated}" + (f" at round {at}" if at != rnd else "")
        self.progress.update(self._rounds, completed=rnd, info=info)

    def privacy_figures(self, relations: dict[str, str], against: dict[str, str]) -> None:
        self._relation = relations.get("epsilon", "")
        self.progress.console.print(figures_line(relations, against))

    def message(self, text: str) -> None:
        """Shown above the bars and logged as a warning (as ``LogReporter`` does)."""
        self.progress.console.print(f"[yellow]{text}")
        log.warning("%s", text)
