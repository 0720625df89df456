"""DP-SGD's composed epsilon on the server: the largest any client reports, and the stop
at ``train.dp_sgd_epsilon_budget``.

Each client composes all of its own rounds of DP-SGD in its node state
(``client.dp_sgd``) and reports ``dp_sgd_epsilon`` (its rounds so far, this one included),
``dp_sgd_epsilon_next`` (after one more round), ``dp_sgd_rounds``, and its per-round
``dp_sgd_sample_rate`` and ``dp_sgd_round_steps``. The guarantee is sample-level: it
protects individual training examples of one client, against the server and anyone who
sees that client's updates; the run's figure is the largest over clients.

The stop is exact: a client's sampling rate and steps are the same every round (its
partition and ``[train]`` do not change), so its next round composes to exactly the
``dp_sgd_epsilon_next`` it reported. Any client may be drawn next, so before each round the
run stops when the largest such figure passes the budget. A client not seen yet has spent
nothing; if its very first round would pass the budget it refuses that round itself (the
client holds the accountant), and the round records the refusal as its rejected update.

A resumed run restarts the in-process engine's clients with empty node state. So that no
figure is under-reported, the resumed run tells every client it may have trained
``prior_rounds`` rounds before (the most any client reported, plus one for a round cut off
unrecorded), and a client composes at least that many; the next-round figures are computed
again for those rounds from each client's reported rate and steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from server.store import UpdateRecord

PROTECTS = "individual training examples of one client (sample-level)"
PROTECTS_AGAINST = "the server and anyone who sees that client's updates"
RELATION = "add/remove-one training example"


class DPSGDLedger:
    """The run's DP-SGD figures from the clients' reports (inactive without DP-SGD)."""

    def __init__(self, train: Mapping[str, Any]) -> None:
        self.noise_multiplier = float(train.get("dp_sgd_noise_multiplier", 0.0))
        self.delta = float(train.get("dp_sgd_delta", 1e-5))
        budget = train.get("dp_sgd_epsilon_budget")
        self.budget = None if budget is None else float(budget)
        self.epsilon = 0.0  # the largest composed figure reported so far
        self.next = 0.0  # the largest figure any client would reach after one more round
        self.rounds = 0  # the most rounds any client composed
        self.prior_rounds = 0  # what every client is told it may have trained before
        self.reported = False  # whether any client reported a figure (secure sums carry none)

    @property
    def active(self) -> bool:
        return self.noise_multiplier > 0

    def observe(self, records: Iterable[UpdateRecord]) -> dict[str, float]:
        """Take a round's updates; the round metric ``dp_sgd_epsilon``: the largest over
        the clients that trained in it (none when no client reported one)."""
        return self._take([r.metrics for r in records if "dp_sgd_epsilon" in r.metrics])

    def _take(self, figures: list[dict[str, float]]) -> dict[str, float]:
        if not self.active or not figures:
            return {}
        self.reported = True
        largest = max(m["dp_sgd_epsilon"] for m in figures)
        self.epsilon = max(self.epsilon, largest)
        self.next = max([self.next, *(m.get("dp_sgd_epsilon_next", 0.0) for m in figures)])
        self.rounds = max([self.rounds, *(int(m.get("dp_sgd_rounds", 0)) for m in figures)])
        return {"dp_sgd_epsilon": largest}

    def over_budget(self) -> str | None:
        """Why the next round must not run (None: it may)."""
        if self.budget is None or self.next <= self.budget:
            return None
        return (f"DP-SGD epsilon of a client would reach {self.next:.4g} > "
                f"train.dp_sgd_epsilon_budget {self.budget:g} (largest so far "
                f"{self.epsilon:.4g})")

    def restore(self, records: Iterable[UpdateRecord]) -> None:
        """On resume: every update recorded for the run (also those after its checkpoint,
        which the resumed run trains again: their privacy was spent)."""
        reported = [r.metrics for r in records if "dp_sgd_epsilon" in r.metrics]
        self._take(reported)
        if not self.active:
            return
        from privacy.dp import PrivacyAccountant  # (dp_accounting: loaded on first use)

        self.prior_rounds = self.rounds + 1
        clients = {(m["dp_sgd_sample_rate"], int(m["dp_sgd_round_steps"])) for m in reported
                   if "dp_sgd_sample_rate" in m and "dp_sgd_round_steps" in m}
        for rate, steps in clients:  # each kind of client, after prior_rounds + 1 rounds
            after = PrivacyAccountant(self.noise_multiplier, delta=self.delta,
                                      sampling_rate=rate).epsilon_after(
                                          steps * (self.prior_rounds + 1))
            self.next = max(self.next, after)

    def summary(self) -> dict[str, Any]:
        """The run summary's DP-SGD entries (none without DP-SGD); ``dp_sgd_epsilon`` is None
        when no client reported one (each client still composes and enforces its own)."""
        if not self.active:
            return {}
        out: dict[str, Any] = {"dp_sgd_epsilon": self.epsilon if self.reported else None,
                               "dp_sgd_delta": self.delta,
                               "dp_sgd_relation": RELATION, "dp_sgd_protects": PROTECTS,
                               "dp_sgd_protects_against": PROTECTS_AGAINST}
        if self.budget is not None:
            out["dp_sgd_epsilon_budget"] = self.budget
        return out

