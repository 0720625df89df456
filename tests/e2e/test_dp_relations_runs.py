"""Whole runs: every privacy figure carries its relation, the same in the summary (what
``--json`` prints), the ledger, the report, the plot's labels and the round lines; and
why client-noised modes claim no amplification under Poisson sampling.

The relations are derived here, mode by mode: central DP speaks for the released model,
replace-one under a secret fixed-size draw, add/remove-one otherwise; local and
distributed DP speak for the server, which sees who replied (zero-out), and for the
released model only under a secret fixed-size draw (replace-one).
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from simulations.config import load_scenario
from simulations.report import ledger_relations, privacy_summary
from simulations.task import ScenarioTask

SAMPLINGS = {"fixed": ["federation.sample_fraction=0.5"],
             "poisson": ["federation.sampling=poisson", "federation.sample_fraction=0.5"],
             "all": ["federation.sample_fraction=1.0"]}
MODES = {"central": [], "local": [],
         "distributed": ["secagg.enabled=true", "dp.rotation=false"]}


def expected(mode: str, sampling: str) -> tuple[str, str | None]:
    secret_sample = sampling == "fixed"  # Poisson is no secret once clients noise alone
    if mode == "central":
        return ("replace-one" if secret_sample else "add/remove-one"), None
    return "zero-out", ("replace-one" if secret_sample else None)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("mode", list(MODES))
def test_every_figure_carries_the_same_relation_everywhere(run_inprocess, store, capsys,
                                                           mode, sampling):
    central = sampling == "poisson" and mode == "central"
    cfg = load_scenario("default", [
        "federation.clients=8", "federation.rounds=2", "train.local_epochs=1",
        f"dp.mode={mode}", "dp.clip=1.0", "dp.noise_multiplier=1.0",
        "aggregation.weight_by=uniform", "federation.min_clients=1" if central else
        "federation.min_clients=2", *SAMPLINGS[sampling], *MODES[mode]])
    summary = run_inprocess(cfg)
    relation, model = expected(mode, sampling)
    # the summary (--json)
    assert summary["relation"] == relation and summary.get("relation_model") == model
    assert ("epsilon_replace_one" in summary) == (relation != "replace-one")
    # the ledger, every round
    ledger = store.privacy_ledger(summary["run_id"])
    assert {(e["relation"], e["relation_model"]) for e in ledger} == {(relation, model)}
    # the plot's labels and the report line come from the ledger
    labels = ledger_relations(ledger[-1])
    assert labels["epsilon"] == summary["relation"]
    assert labels.get("epsilon_model") == summary.get("relation_model")
    line = privacy_summary(ledger)
    shown = dict(re.findall(r"(epsilon\w*) [\d.e+-]+ \(([^)]+)\)", line))
    assert shown == labels
    assert shown["epsilon"] == relation
    # the round lines and the run's last line
    out = capsys.readouterr().out
    assert f"epsilon {summary['epsilon']:.4g} ({relation})" in out
    if model is not None:
        assert f"epsilon_model {summary['epsilon_model']:.4g} ({model})" in out


def test_local_dp_under_poisson_sampling_tells_the_cohort_size(run_inprocess, store):
    """Each client adds N(0, (zC)^2) per coordinate and the mean divides by the number
    that replied, so ||theta_t - theta_(t-1)||^2 is about d z^2 C^2 / |S_t|: the model
    alone tells how many took part, and amplification by a secret Poisson draw would be
    a claim about a secret the model gives away.

    The estimate d z^2 C^2 / ||theta_t - theta_(t-1)||^2 is |S_t| d / chi^2_d, off by a
    relative sqrt(2 / d): with d = 38,410 (hidden layer 512) that is 0.1 at |S| = 14, five
    standard deviations inside the rounding (the default model's d = 4,810 left about two,
    and some 10% of runs failed)."""
    z, clip, rounds = 5.0, 1.0, 4
    cfg = load_scenario("default", [
        "federation.clients=20", f"federation.rounds={rounds}", "train.local_epochs=1",
        "model.hidden=[512]",
        "federation.sampling=poisson", "federation.sample_fraction=0.5",
        "federation.min_clients=1", "dp.mode=local", f"dp.clip={clip}",
        f"dp.noise_multiplier={z}", "aggregation.weight_by=uniform"])
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, models=models)
    dim = ScenarioTask.from_config(cfg).initial_params()[1].dim
    recovered = [round(dim * (z * clip) ** 2 / float(np.sum((b - a) ** 2)))
                 for a, b in itertools.pairwise(models)]
    replied = [sum(u.fate == "accepted" for _, u in store.updates(summary["run_id"], round=r))
               for r in range(1, rounds + 1)]
    assert recovered == replied
    assert len(set(replied)) > 1 or rounds < 3  # the sizes did vary
    assert "epsilon_model" not in summary  # so no amplified figure is claimed
