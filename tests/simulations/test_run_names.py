"""Runs told apart: ``--name`` or a scenario's ``name`` names a run, ``fedring runs`` shows
what each run changed of its scenario (cut to fit), and a resumed run keeps its name."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from server.store import Store
from simulations.cli import main
from simulations.config import load_scenario

TASK = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(3, 2))

    def load_partition(partition_id, num_partitions):
        g = torch.Generator().manual_seed(partition_id)
        return TensorDataset(torch.randn(16, 3, generator=g), torch.tensor([0, 1] * 8))
""")


@pytest.fixture
def task(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_task.py"
    path.write_text(TASK)
    return path


def _fedring(capsys, monkeypatch, *argv: str, columns: int = 200) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _simulate(capsys, monkeypatch, db: str, task: Path, *extra: str) -> dict:
    code, out, err = _fedring(capsys, monkeypatch, "simulate", "--db", db, "--clients", "2",
                              "--rounds", "1", "--set", f"task.module={task}", "--json", *extra)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _runs(capsys, monkeypatch, db: str) -> list[dict]:
    code, out, _ = _fedring(capsys, monkeypatch, "runs", "--db", db, "--json")
    assert code == 0
    return json.loads(out)


def test_a_named_run_lists_its_name_and_what_it_changed(tmp_path, task, capsys, monkeypatch):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    named = _simulate(capsys, monkeypatch, db, task, "--name", "med 3",
                      "--set", "aggregation.combine=median", "--seed", "4")
    plain = _simulate(capsys, monkeypatch, db, task)
    assert named["name"] == "med 3" and named["scenario"] == "default"
    assert plain["name"] == "default"  # unnamed: the scenario's own name, as before
    runs = {r["run"]: r for r in _runs(capsys, monkeypatch, db)}
    row = runs[named["run_id"]]
    assert row["name"] == "med 3" and row["scenario"] == "default"
    assert row["overrides"] == {"task.module": str(task), "aggregation.combine": "median",
                                "federation.clients": 2, "federation.rounds": 1, "seed": 4}
    assert row["differs"] == ("task=tiny_task.py clients=2 rounds=1 seed=4 "
                              "aggregation.combine=median scenario=default")
    assert runs[plain["run_id"]]["differs"] == "task=tiny_task.py clients=2 rounds=1"

    code, out, _ = _fedring(capsys, monkeypatch, "runs", "--db", db, columns=80)
    lines = out.splitlines()
    assert code == 0 and max(len(line) for line in lines) <= 80
    line = next(line for line in lines if named["run_id"] in line)
    assert "med 3" in line and "…" not in out  # too narrow for a column: whole, below
    below = " ".join(out[out.index("what each run changed"):].split())
    assert f"{named['run_id']} {row['differs']}" in below
    code, out, _ = _fedring(capsys, monkeypatch, "runs", "--db", db, columns=200)
    line = next(line for line in out.splitlines() if named["run_id"] in line)
    assert "aggregation.combine=median scenario=default" in line and "…" not in line


def test_a_scenario_files_name_names_the_run_and_the_file_stays_recorded(tmp_path, task):
    scenario = tmp_path / "sweep.toml"
    scenario.write_text(f'name = "lr sweep, low"\n[task]\nmodule = "{task}"\n'
                        "[federation]\nclients = 2\n")
    config = load_scenario(str(scenario), ["train.lr=0.01"])
    assert config["name"] == "lr sweep, low"
    assert config["scenario"] == str(scenario.resolve())
    assert config["overrides"] == {"train.lr": 0.01}
    assert load_scenario(str(scenario), name="mine")["name"] == "mine"  # --name wins
    scenario.write_text(f'[task]\nmodule = "{task}"\n')
    assert load_scenario(str(scenario))["name"] == "sweep"  # no name: the file's


@pytest.mark.parametrize("name", ["", "   ", "tab\there", "new\nline", "x" * 65])
def test_a_bad_name_is_refused_at_start(tmp_path, task, capsys, monkeypatch, name):
    db = tmp_path / "runs.db"
    code, _, err = _fedring(capsys, monkeypatch, "simulate", "--db", f"sqlite:///{db}",
                            "--set", f"task.module={task}", "--name", name)
    assert code == 2 and "--name" in err and "1 to 64 printable characters" in err
    assert len(err.strip().splitlines()) == 1 and not db.exists()


@pytest.mark.parametrize("line, message", [('name = 3', "name must be a string, got 3"),
                                           ('name = ""', "not a usable run name")])
def test_a_bad_name_in_a_scenario_is_refused_naming_the_key(tmp_path, line, message):
    scenario = tmp_path / "bad.toml"
    scenario.write_text(f"{line}\n")
    with pytest.raises(ValueError, match=message):
        load_scenario(str(scenario))
    assert load_scenario("default", name="x" * 64)["name"] == "x" * 64  # the longest


def test_a_resumed_run_keeps_its_name_and_refuses_another(tmp_path, task, capsys,
                                                          monkeypatch):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = _simulate(capsys, monkeypatch, db, task, "--name", "keeper")["run_id"]
    code, _, err = _fedring(capsys, monkeypatch, "simulate", "--db", db, "--resume", run_id,
                            "--name", "other")
    assert code == 2 and "drop --name" in err
    code, out, err = _fedring(capsys, monkeypatch, "simulate", "--db", db, "--resume", run_id,
                              "--json")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["name"] == "keeper"
    (row,) = _runs(capsys, monkeypatch, db)
    assert row["name"] == "keeper" and row["differs"].startswith("task=tiny_task.py")


def test_a_run_stored_before_overrides_were_recorded_differs_in_nothing(tmp_path, capsys,
                                                                        monkeypatch):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store(db) as store:
        store.create_run(config={"name": "default"}, seed=0, name="default")
    (row,) = _runs(capsys, monkeypatch, db)
    assert row["differs"] == "" and row["overrides"] == {} and row["scenario"] is None


def test_flwr_run_names_a_run_with_the_name_run_config_key():
    from simulations.apps import config_from_run_config

    assert config_from_run_config({"scenario": "default", "name": "trial-3"})["name"] == \
        "trial-3"
    assert config_from_run_config({"scenario": "default", "name": ""})["name"] == "default"
    with pytest.raises(ValueError, match="name"):
        config_from_run_config({"scenario": "default", "name": "x" * 65})
