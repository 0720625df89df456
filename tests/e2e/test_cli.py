"""The ``fedring`` command as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FEDRING = [sys.executable, "-m", "simulations.cli"]


def fedring(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*FEDRING, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_simulate_json_runs_and_report(tmp_path):
    db = f"sqlite:///{tmp_path / 'store.db'}"
    proc = fedring("simulate", "--clients", "4", "--rounds", "2", "--seed", "3", "--db", db,
                   "--set", "train.local_epochs=1", "--set", "data.partitioner=iid", "--json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("run_id", "rounds", "final_accuracy", "final_loss", "wall_s", "store"):
        assert key in summary
    assert summary["rounds"] == 2 and summary["clients"] == 4
    assert 0.5 < summary["final_accuracy"] <= 1.0

    runs = fedring("runs", "--db", db, cwd=tmp_path)
    assert runs.returncode == 0 and summary["run_id"] in runs.stdout

    out = tmp_path / "plots"
    report = fedring("report", summary["run_id"], "--db", db, "--out", str(out), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    png = out / f"{summary['run_id']}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "accuracy" in report.stdout


@pytest.mark.parametrize("args, message", [
    (["--set", "train.nonsense=1"], "train.nonsense"),
    (["--set", "data.dataset=imagenet"], "data.dataset 'imagenet' is unknown"),
    (["--scenario", "nope"], "unknown scenario 'nope'"),
    (["--clients", "5000"], "clients"),
    (["--set", "federation.rounds=zero"], "federation.rounds must be int"),
    (["--set", "aggregation.server_opt=sgd"], "aggregation.server_opt 'sgd' is unknown"),
])
def test_bad_configuration_fails_at_start_with_a_message(tmp_path, args, message):
    proc = fedring("simulate", "--db", f"sqlite:///{tmp_path / 's.db'}", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s.db").exists() or "run" not in proc.stdout


@pytest.mark.slow
def test_target_on_federated_stops_on_the_clients_figure_and_report_shows_it(tmp_path):
    """Central accuracy passes 0.25 after round 1 (0.30 with this seed); the clients first
    evaluate in round 2 (every 2nd round), so a target on their figure stops there."""
    db = f"sqlite:///{tmp_path / 'store.db'}"
    proc = fedring("simulate", "--clients", "4", "--rounds", "5", "--seed", "3", "--db", db,
                   "--set", "train.local_epochs=1", "--set", "federation.evaluate_fraction=1",
                   "--set", "federation.evaluate_every=2", "--target-accuracy", "0.25",
                   "--target-on", "federated", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds"] == 2 and summary["reached_target"] is True
    assert summary["federated_accuracy"] >= 0.25
    assert (f"fed acc {summary['federated_accuracy']:.3f} "
            f"(p10 {summary['federated_accuracy_p10']:.2f}, "
            f"min {summary['federated_accuracy_min']:.2f})") in proc.stderr

    report = fedring("report", summary["run_id"], "--db", db, "--json", cwd=tmp_path)
    rows = {r["round"]: r for r in json.loads(report.stdout)["rounds"]}
    assert rows[1]["accuracy"] >= 0.25 and "federated_accuracy" not in rows[1]
    for key in ("federated_accuracy", "federated_accuracy_p10", "federated_accuracy_min"):
        assert rows[2][key] == summary[key]
    table = fedring("report", summary["run_id"], "--db", db, "--out", str(tmp_path), cwd=tmp_path)
    assert f"{summary['federated_accuracy_p10']:.4f}" in table.stdout
