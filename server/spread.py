"""A federated evaluation round's figures: the clients' accuracies and their spread.

Each round that evaluates on the clients records, from the accepted answers, the
example-weighted mean accuracy (what a central evaluation on the union of their held-out
splits would give), the unweighted mean (every client counts once), the standard
deviation (population, ddof 0), the 10th and 90th percentiles (numpy's linear
interpolation) and the minimum: how the worst clients fare, not only the average. Where
clients use a model of their own (FedBN), the same figures for it carry "_personal".
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from server.store import EvalRecord

PREFIX = "federated"
COUNT = f"{PREFIX}_clients"  # accepted answers the figures come from
ACCURACY = f"{PREFIX}_accuracy"  # example-weighted mean accuracy of the global model
LOSS = f"{PREFIX}_loss"
PERSONAL = "_personal"  # suffix of the clients' own models' figures
STATS = ("mean", "std", "p10", "p90", "min")  # suffixes of ACCURACY's spread


def accuracy_key(stat: str | None = None, *, personal: bool = False) -> str:
    """The metric name of a federated accuracy figure: ``stat`` one of :data:`STATS` (None:
    the weighted mean), of the clients' own models when ``personal``."""
    return ACCURACY + (PERSONAL if personal else "") + (f"_{stat}" if stat else "")


def _figures(accuracies: np.ndarray, losses: np.ndarray, weights: np.ndarray,
             personal: bool) -> dict[str, float]:
    suffix = PERSONAL if personal else ""
    return {
        LOSS + suffix: float(np.average(losses, weights=weights)),
        accuracy_key(personal=personal): float(np.average(accuracies, weights=weights)),
        accuracy_key("mean", personal=personal): float(accuracies.mean()),
        accuracy_key("std", personal=personal): float(accuracies.std()),
        accuracy_key("p10", personal=personal): float(np.percentile(accuracies, 10)),
        accuracy_key("p90", personal=personal): float(np.percentile(accuracies, 90)),
        accuracy_key("min", personal=personal): float(accuracies.min()),
    }


def spread(records: Iterable[EvalRecord]) -> dict[str, float]:
    """The round's federated figures from its accepted answers ({} when there are none);
    the personal ones when every accepted answer has them."""
    accepted = [r for r in records if r.fate == "accepted"]
    if not accepted:
        return {}
    weights = np.array([float(r.num_examples or 0) for r in accepted])
    if weights.sum() <= 0:
        weights = np.ones(len(accepted))
    out = {COUNT: float(len(accepted))}
    out.update(_figures(np.array([float(r.accuracy or 0.0) for r in accepted]),
                        np.array([float(r.loss or 0.0) for r in accepted]), weights,
                        personal=False))
    if all(r.accuracy_personal is not None for r in accepted):
        out.update(_figures(np.array([float(r.accuracy_personal or 0.0) for r in accepted]),
                            np.array([float(r.loss_personal or 0.0) for r in accepted]),
                            weights, personal=True))
    return out
