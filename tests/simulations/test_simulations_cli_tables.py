"""``fedring runs`` and ``fedring report`` read at 80 columns, and as JSON for scripts."""

from __future__ import annotations

import json

import pytest

from server.store import Store, UpdateRecord
from simulations.cli import main

ROUNDS = 10


@pytest.fixture
def db(tmp_path) -> tuple[str, str]:
    """A store with one finished 10-round run (round 0: the initial model) and a DP ledger."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store(url) as store:
        run_id = store.create_run(config={"federation": {"rounds": ROUNDS}}, seed=0,
                                  name="a-rather-long-scenario-name")
        store.record_round(run_id, round=0, model_version=0, metrics={"accuracy": 0.1})
        for rnd in range(1, ROUNDS + 1):
            store.record_round(run_id, round=rnd, model_version=rnd, num_sampled=20,
                               num_replies=20, num_accepted=19, num_rejected=1,
                               metrics={"accuracy": 0.5 + rnd / 40, "loss": 1.0 / rnd,
                                        "train_loss": 0.3, "bytes_up": 1e6, "bytes_down": 2e6,
                                        "epsilon": 0.123 * rnd},
                               wall_s=0.25,
                               updates=[UpdateRecord("c1", "rejected", reason="NaN")])
        store.finish_run(run_id, status="completed",
                         summary={"final_accuracy": 0.75, "rounds": ROUNDS})
    return url, run_id


def _run(capsys, monkeypatch, columns: int, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("columns", [80, 120])
def test_runs_counts_training_rounds_and_never_cuts_an_id(db, capsys, monkeypatch, columns):
    url, run_id = db
    code, out, _ = _run(capsys, monkeypatch, columns, "runs", "--db", url)
    assert code == 0 and max(len(line) for line in out.splitlines()) <= columns
    row = next(line for line in out.splitlines() if run_id in line).split()
    assert row[0] == run_id and str(ROUNDS) in row and str(ROUNDS + 1) not in row


def test_runs_json(db, capsys, monkeypatch):
    url, run_id = db
    code, out, _ = _run(capsys, monkeypatch, 80, "runs", "--db", url, "--json")
    (run,) = json.loads(out)
    assert code == 0 and run["run"] == run_id and run["rounds"] == ROUNDS
    assert run["status"] == "completed" and run["accuracy"] == 0.75


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_report_shows_whole_headers_at_narrow_widths(db, tmp_path, capsys, monkeypatch,
                                                     columns):
    url, run_id = db
    code, out, _ = _run(capsys, monkeypatch, columns, "report", run_id, "--db", url, "--out",
                        str(tmp_path / "plots"))
    assert code == 0
    header = next(line for line in out.splitlines() if "round" in line and "status" in line)
    for column in ("round", "status", "accepted", "rejected", "dropped", "accuracy", "loss",
                   "epsilon"):
        assert column in header.split(), header
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= columns
    assert "bytes_up" not in out


def test_report_wide_has_every_column(db, tmp_path, capsys, monkeypatch):
    url, run_id = db
    _, out, _ = _run(capsys, monkeypatch, 400, "report", run_id, "--db", url, "--wide",
                     "--out", str(tmp_path))
    for column in ("version", "sampled", "bytes_up", "train_loss", "wall_s"):
        assert column in out


def test_report_json(db, tmp_path, capsys, monkeypatch):
    url, run_id = db
    code, out, _ = _run(capsys, monkeypatch, 80, "report", run_id, "--db", url, "--json",
                        "--out", str(tmp_path / "plots"))
    report = json.loads(out)
    assert code == 0 and report["run"]["run"] == run_id
    assert report["run"]["num_rounds"] == ROUNDS
    assert [r["round"] for r in report["rounds"]] == list(range(ROUNDS + 1))
    assert report["rounds"][-1]["bytes_up"] == 1_000_000
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize("command", [["runs"], ["report", "r123"]])
def test_a_store_that_does_not_exist_is_named_not_created(tmp_path, capsys, command):
    path = tmp_path / "nothing.db"
    assert main([*command, "--db", f"sqlite:///{path}"]) == 2
    err = capsys.readouterr().err
    assert f"there is no run store at {path}" in err and len(err.strip().splitlines()) == 1
    assert not path.exists()


def test_certs_to_an_unwritable_place_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["certs", "--out", str(tmp_path / "file" / "certs")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the certificates to" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("url, says", [
    ("postgres://u@localhost/db", "postgresql+psycopg://"),
    ("mysql://u@localhost/db", "MySQLdb"),
])
def test_simulate_with_a_bad_db_url_is_one_line(tmp_path, capsys, url, says):
    assert main(["simulate", "--db", url, "--rounds", "1", "--clients", "2"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
