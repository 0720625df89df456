"""Progress hooks a round driver calls; the CLI shows them live, the default logs them."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("fedring")


class Reporter:
    """No-op base: override what you want to show."""

    def run_started(self, run_id: str, config: dict[str, Any]) -> None: ...

    def round_started(self, rnd: int, sampled: int) -> None: ...

    def client_done(self, rnd: int, done: int, sampled: int) -> None: ...

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None: ...

    def message(self, text: str) -> None: ...

    def run_finished(self, summary: dict[str, Any]) -> None: ...


class LogReporter(Reporter):
    """Reports through the ``fedring`` logger (used under ``flwr run``)."""

    def run_started(self, run_id: str, config: dict[str, Any]) -> None:
        log.info("run %s started", run_id)

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                          if isinstance(v, float))
        log.info("round %d: %s", rnd, shown)

    def message(self, text: str) -> None:
        log.warning("%s", text)

    def run_finished(self, summary: dict[str, Any]) -> None:
        log.info("run finished: %s", summary)


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
