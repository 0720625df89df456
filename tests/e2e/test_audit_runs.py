"""The one-shot canary audit ([audit]) through the real ServerApp, ClientApp and pipeline.

Sizes: the default scenario's MLP (d = 4810), 20 clients, 10 rounds, one local epoch.
The estimate's ``mu`` has a statistical error of about sqrt((2 + mu^2/2) / K); the
summary's ``epsilon_audit_lower`` is its one-sided 95% lower bound, and
``epsilon_audit_reference`` the exact (PLD, add/remove-one) epsilon of what a canary went
through, computed again here with dp_accounting. No test relies on seeded cohorts under
DP: every DP run here either samples everyone (Poisson, q = 1) or compares statistics
only; the runs that must each land on the right side of a 95% bound replace the run's
operating-system entropy with a seeded stream (``seeded_entropy``), so they are repeatable.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from itertools import pairwise

import dp_accounting
import numpy as np
import pytest

import server.dp
from server.app import run_server
from server.audit import CanaryAudit
from simulations.apps import build_task, client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid


def fedring(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    """The ``fedring`` command in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "simulations.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def _pld(q: float, z: float, rounds: int, delta: float = 1e-5) -> float:
    """dp_accounting's PLD under add/remove-one: ``rounds`` Poisson(q) sampled Gaussian
    rounds of multiplier z (plain Gaussian rounds at q = 1)."""
    acc = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dp_accounting.GaussianDpEvent(z)
    acc.compose(event if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, event), rounds)
    return acc.get_epsilon(delta)


@pytest.fixture
def seeded_entropy(monkeypatch):
    """``seed(n)``: from then on, what the run draws from operating-system entropy (the
    canaries, their participation, the DP noise, the batch order) comes from a stream
    seeded with n, so a run is repeatable; explicitly seeded generators are unchanged."""
    original = np.random.default_rng

    def seed(value: int) -> None:
        stream = original(value)
        monkeypatch.setattr(np.random, "default_rng", lambda seed=None: original(
            int(stream.integers(2**63)) if seed is None else seed))

        def randbits(k: int) -> int:
            return int.from_bytes(stream.bytes((k + 7) // 8), "big") >> (-k % 8)

        monkeypatch.setattr(secrets, "randbits", randbits)

    return seed



BASE = ["train.local_epochs=1", "train.batch_size=128", "federation.rounds=10",
        'federation.sampling="poisson"']
CENTRAL = [*BASE, 'dp.mode="central"', 'aggregation.weight_by="uniform"', "dp.clip=1.0",
           "dp.delta=1e-5"]


def test_central_dp_estimate_stays_below_the_accountant(run_inprocess):
    cfg = load_scenario("default", [*CENTRAL, "dp.noise_multiplier=1.0",
                                    "federation.sample_fraction=0.5", "audit.canaries=100"])
    summary = run_inprocess(cfg)
    # the accountant: about 11.5 here; the audit of the final model: about 6 +- 1.5
    assert summary["audit_delta"] == summary["delta"] == 1e-5
    assert 0 < summary["epsilon_audit"] <= summary["epsilon"]
    # each canary took part in about half of the 10 rounds
    assert summary["audit_participations"] == pytest.approx(100 * 10 * 0.5, rel=0.15)
    # the reference: 10 Poisson(0.5) rounds at z = 1, exact (PLD), below the RDP accountant
    assert summary["epsilon_audit_reference"] == pytest.approx(_pld(0.5, 1.0, 10), rel=1e-5)
    assert summary["epsilon_audit_reference"] < summary["epsilon"]
    assert summary["epsilon_audit_lower"] <= summary["epsilon_audit"]
    assert summary["audit_flag"] is False


def test_correct_full_participation_runs_stay_below_the_exact_epsilon(run_inprocess,
                                                                     seeded_entropy):
    """q = 1: every canary in every round, so the final model is one Gaussian mechanism of
    mu = sqrt(T) / z per canary and the audit is tight: the estimates scatter around the
    exact epsilon (above it in some runs), the lower bounds stay below it."""
    cfg = load_scenario("default", [*CENTRAL, "dp.noise_multiplier=2.0",
                                    "federation.sample_fraction=1.0", "audit.canaries=100"])
    exact = _pld(1.0, 2.0, 10)  # 7.51; the RDP accountant says 8.08
    runs = []
    for seed in range(4):
        seeded_entropy(seed)
        runs.append(run_inprocess(cfg))
    for summary in runs:
        assert summary["epsilon_audit_reference"] == pytest.approx(exact, rel=1e-5)
        assert summary["epsilon"] > 1.05 * exact
        assert summary["epsilon_audit_lower"] <= exact and summary["audit_flag"] is False
    estimates = [s["epsilon_audit"] for s in runs]
    assert np.mean(estimates) == pytest.approx(exact, rel=0.2)


def test_halved_noise_is_caught_by_the_audit(run_inprocess, monkeypatch, capsys):
    """A test double of the noise stage adds half the std while the accountant still
    charges the full z: the audit's lower bound exceeds the exact epsilon, the run is
    flagged and says so."""
    honest = server.dp.central_dp_mean

    def halved(clipped_sum, count, clip, noise_multiplier, rng):
        return honest(clipped_sum, count, clip, noise_multiplier / 2, rng)

    monkeypatch.setattr(server.dp, "central_dp_mean", halved)
    cfg = load_scenario("default", [*CENTRAL, "dp.noise_multiplier=2.0",
                                    "federation.sample_fraction=1.0", "audit.canaries=100"])
    summary = run_inprocess(cfg)
    # q = 1: the exact figure is the plain Gaussian's, 7.51 at z = 2, T = 10
    assert summary["epsilon_audit_reference"] == pytest.approx(_pld(1.0, 2.0, 10), rel=1e-5)
    assert summary["epsilon_audit_lower"] > summary["epsilon_audit_reference"]
    assert summary["audit_flag"] is True  # the estimate itself: about 16, as with z = 1
    assert "WARNING: privacy audit" in capsys.readouterr().out


def test_without_dp_the_estimate_is_far_above_a_dp_run(run_inprocess):
    # a wider MLP (d = 19210): the canaries' cosines grow with sqrt(d) without noise
    cfg = load_scenario("default", [*BASE, "model.hidden=[256]", "audit.canaries=50"])
    summary = run_inprocess(cfg)
    assert "epsilon" not in summary and summary["audit_delta"] == 1e-5
    # what central DP at z = 1 would claim for the same 10 rounds with everyone taking part
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(1.0), 10)
    central = acc.get_epsilon(1e-5)  # 19.05
    assert summary["epsilon_audit"] > 3 * central  # about 120
    assert summary["epsilon_audit_lower"] > 2 * central
    assert summary["epsilon_audit_reference"] is None and summary["audit_flag"] is None


def test_distributed_dp_estimate_stays_below_the_accountant(run_inprocess, store):
    cfg = load_scenario("default", [*BASE, 'dp.mode="distributed"', "secagg.enabled=true",
                                    'aggregation.weight_by="uniform"', "dp.clip=1.0",
                                    "dp.noise_multiplier=1.0", "federation.sample_fraction=0.5",
                                    "audit.canaries=100"])
    summary = run_inprocess(cfg)
    # the audit looks at the released model, which the server's figure bounds too
    assert 0 < summary["epsilon_audit"] <= summary.get("epsilon_model", summary["epsilon"])
    # the exact figure for a canary: each released round's charged multiplier (the
    # ledger's), Poisson(0.5) sampled, under add/remove-one; a round that released nothing
    # (a secure round aborted, as a loaded machine can make one) exposes no canary
    ledger = store.privacy_ledger(summary["run_id"])
    assert len(ledger) == 10
    infos = store.rounds(summary["run_id"])
    released = {b.round for a, b in pairwise(infos) if b.model_version > a.model_version}
    assert len(released) >= 5
    charged = [row["noise_multiplier"] for row in ledger if row["round"] in released]
    acc = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for z in charged:
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)))
    assert summary["epsilon_audit_reference"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-5)
    assert summary["epsilon_audit_lower"] <= summary["epsilon_audit_reference"]
    assert summary["audit_flag"] is False


def _final_params(store, summary) -> np.ndarray:
    return store.load_checkpoint(summary["run_id"]).params


SMALL = ["federation.clients=5", "federation.rounds=3", "train.local_epochs=1"]


def test_canaries_never_enter_a_run_without_audit(run_inprocess, store):
    plain = run_inprocess(load_scenario("default", SMALL))
    off = run_inprocess(load_scenario("default", [*SMALL, "audit.canaries=0"]))
    on = run_inprocess(load_scenario("default", [*SMALL, "audit.canaries=20"]))
    assert not any(k.startswith(("audit", "epsilon_audit")) for k in [*plain, *off])
    np.testing.assert_array_equal(_final_params(store, plain), _final_params(store, off))
    assert not np.array_equal(_final_params(store, plain), _final_params(store, on))
    # canaries are not clients: every round accepted exactly the 5 real ones
    assert [r.num_accepted for r in store.rounds(on["run_id"])[1:]] == [5, 5, 5]
    assert "epsilon_audit" in on and on["audit_participations"] == 20 * 3



@pytest.mark.slow
def test_cli_json_line_and_report_show_the_audit_beside_the_accountant(tmp_path):
    db = f"sqlite:///{tmp_path / 'store.db'}"
    proc = fedring("simulate", "--clients", "5", "--rounds", "3", "--db", db, "--json",
                   *(f"--set={o}" for o in [*SMALL, 'dp.mode="central"', "dp.clip=1.0",
                                           'aggregation.weight_by="uniform"',
                                           "audit.canaries=20"]), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epsilon_audit"] >= 0 and summary["audit_canaries"] == 20
    assert 0 <= summary["epsilon_audit_lower"] <= summary["epsilon_audit"]
    assert summary["audit_flag"] is (summary["epsilon_audit_lower"]
                                     > summary["epsilon_audit_reference"])
    assert (f"95% lower bound {summary['epsilon_audit_lower']:.3f}, exact "
            f"{summary['epsilon_audit_reference']:.3f} (add/remove-one)") in " ".join(
                proc.stderr.split())  # the console wraps long lines at a space
    report = fedring("report", summary["run_id"], "--db", db, "--out", str(tmp_path),
                     cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    # the console wraps long lines at a space: rejoin them
    flat = " ".join(report.stdout.split())
    line = flat[flat.index("privacy audit:"):]
    assert f"epsilon_audit {summary['epsilon_audit']:.4g} (one-shot canary" in line
    assert f"95% lower bound {summary['epsilon_audit_lower']:.4g}" in line
    assert (f"exact epsilon for a canary {summary['epsilon_audit_reference']:.4g} "
            "(PLD, add/remove-one)") in line
    assert ("FLAGGED" in line) is summary["audit_flag"]
    assert f"the accountant's epsilon {summary['epsilon']:.4g}" in line


def test_a_resumed_run_keeps_its_canaries(run_inprocess, store, db_url):
    cfg = load_scenario("default", [*SMALL, "audit.canaries=20"])
    first = run_inprocess(cfg)

    def saved_audit() -> dict:
        state = store.load_checkpoint(first["run_id"]).state["pipeline"]
        return next(v for v in state.values() if "entropy" in v)

    before = saved_audit()
    assert before["rounds"] == 3 and sum(before["participations"]) == 20 * 3
    longer = {**cfg, "federation": {**cfg["federation"], "rounds": 5}}
    summary = run_server(InProcessGrid(client_app, 5), longer, task=build_task(longer),
                         store_url=db_url, resume=first["run_id"])
    after = saved_audit()
    assert after["entropy"] == before["entropy"] and after["rounds"] == 5
    assert summary["audit_participations"] == 20 * 5


def test_without_dp_canaries_are_sized_from_the_accepted_updates_only(run_inprocess, store,
                                                                      monkeypatch):
    """An attacker whose huge updates ``aggregation.max_norm`` rejects must not size the
    canaries (it would inflate epsilon_audit): each round's canary norm is the median norm
    of that round's accepted updates, as stored."""
    sized: list[float] = []
    honest = CanaryAudit._norm_and_scale

    def spy(self, count):
        norm, scale = honest(self, count)
        sized.append(norm)
        return norm, scale

    monkeypatch.setattr(CanaryAudit, "_norm_and_scale", spy)
    cfg = load_scenario("default", [*SMALL, "audit.canaries=10", "aggregation.max_norm=100.0",
                                    'attack.kind="scale"', "attack.scale=1e6",
                                    "attack.fraction=0.4"])
    summary = run_inprocess(cfg)
    assert len(sized) == summary["rounds"] == 3
    for rnd, norm in enumerate(sized, start=1):
        records = [u for _, u in store.updates(summary["run_id"], round=rnd)]
        accepted = [u.norm for u in records if u.fate == "accepted"]
        assert any(u.fate == "rejected" for u in records) and accepted
        assert norm == pytest.approx(float(np.median(accepted)), rel=1e-6)
        assert norm < 100.0
