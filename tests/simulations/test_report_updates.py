"""``fedring report`` on a real run's store: each update's fate and whole reason with
``--updates``, the JSON's run/rounds/updates, every ``--wide`` column whole at 60 and 80
columns (more tables, not cut ones) and the noise-to-signal column of central DP."""

from __future__ import annotations

import json
import re

import pytest

from server.store import Store, UpdateRecord
from simulations.cli import main, run_simulation
from simulations.config import load_scenario
from simulations.report import HEADERS

ROUNDS = 2
# 4 clients, one of them scaling its delta 1000x over max_norm: rejected with a reason every
# round; central DP (noise_to_signal) and a federated evaluation (the fed columns)
SETTINGS = ["federation.clients=4", f"federation.rounds={ROUNDS}", "train.local_epochs=1",
            "data.partitioner=iid", "aggregation.max_norm=10", "attack.kind=scale",
            "attack.scale=1000", "attack.fraction=0.25", "dp.mode=central",
            "aggregation.weight_by=uniform", "dp.noise_multiplier=0.8",
            "federation.evaluate_fraction=1"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[str, str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'runs.db'}"
    summary = run_simulation(load_scenario("default", SETTINGS), engine="inprocess", db=url)
    return url, summary["run_id"]


def _report(capsys, monkeypatch, columns: int, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _stored(url: str, run_id: str, rnd: int | None = None) -> list:
    with Store(url) as store:
        return store.updates(run_id, round=rnd)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("columns", [80, 60])  # a table at 80, reasons below rows at 60
def test_updates_shows_every_stored_update_with_its_whole_reason(real_run, tmp_path, capsys,
                                                                  monkeypatch, columns):
    url, run_id = real_run
    updates = _stored(url, run_id)
    rejected = [(rnd, u) for rnd, u in updates if u.fate == "rejected"]
    assert len(updates) == 4 * ROUNDS and len(rejected) == ROUNDS  # the attacker's, each round
    code, out, _ = _report(capsys, monkeypatch, columns, run_id, "--db", url, "--updates",
                           "--out", str(tmp_path / "plots"))
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns
    flat = _flat(out)
    for _, u in rejected:
        assert "exceeds max_norm 10" in u.reason
        assert _flat(u.reason) in flat, (u.reason, out)  # wrapped, never cut
    fields = [re.findall(r"\S+", line) for line in out.splitlines()]
    for rnd, u in updates:  # each update's round, client, fate and norm on one line
        cells = [str(rnd), u.client_id, u.fate, f"{u.norm:.4f}"]
        assert any(all(c in line for c in cells) for line in fields), (cells, out)
    assert not (tmp_path / "plots").exists()  # the updates only: no plot


def test_updates_of_one_round_and_in_json(real_run, capsys, monkeypatch):
    url, run_id = real_run
    code, out, _ = _report(capsys, monkeypatch, 80, run_id, "--db", url, "--updates",
                           "--round", "2", "--json")
    report = json.loads(out)
    stored = _stored(url, run_id, 2)
    assert code == 0 and len(stored) == 4
    assert [(u["round"], u["client"], u["fate"], u["reason"], u["norm"], u["weight"],
             u["staleness"], u["num_examples"]) for u in report["updates"]] == [
        (2, u.client_id, u.fate, u.reason, u.norm, u.weight, u.staleness, u.num_examples)
        for _, u in stored]
    code, out, _ = _report(capsys, monkeypatch, 80, run_id, "--db", url, "--updates",
                           "--round", "1")
    assert code == 0 and "round 1 of run" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"^\d+\s", line)]
    assert rows == ["1"] * 4


def test_report_json_names_the_run_and_its_rounds(real_run, capsys, monkeypatch):
    url, run_id = real_run
    code, out, _ = _report(capsys, monkeypatch, 80, run_id, "--db", url, "--json")
    report = json.loads(out)
    assert code == 0 and "rounds_table" not in report and "updates" not in report
    assert report["run"]["run"] == run_id and report["run"]["num_rounds"] == ROUNDS
    assert "rounds" not in report["run"] and report["run"]["status"] == "completed"
    assert [r["round"] for r in report["rounds"]] == list(range(ROUNDS + 1))
    assert [r["rejected"] for r in report["rounds"]] == [0, 1, 1]
    assert report["summary"]["rounds"] == ROUNDS and report["privacy"].startswith("central")
    assert set(report) == {"run", "rounds", "privacy", "audit", "summary"}


@pytest.mark.parametrize("argv, says", [
    (["--updates", "--round", "9"], "has no round 9: it has rounds 0 to 2"),
    (["--round", "1"], "--round picks the round whose updates to show: add --updates"),
])
def test_a_round_it_does_not_have_or_without_updates_is_one_line(real_run, capsys,
                                                                  monkeypatch, argv, says):
    url, run_id = real_run
    code, out, err = _report(capsys, monkeypatch, 80, run_id, "--db", url, *argv)
    assert code == 2 and not out and err.startswith("fedring: error: ")
    assert says in err and len(err.strip().splitlines()) == 1


def _tables(out: str) -> list[list[str]]:
    """Each table's header lines (one or two above its rule)."""
    lines = out.splitlines()
    return [lines[max(0, i - 2):i] for i, line in enumerate(lines) if set(line.strip()) == {"─"}]


@pytest.mark.parametrize("columns", [80, 60])
def test_wide_at_narrow_widths_splits_into_tables_and_cuts_nothing(real_run, tmp_path, capsys,
                                                                   monkeypatch, columns):
    url, run_id = real_run
    with Store(url) as store:
        keys = {k for r in store.rounds(run_id) for k in r.metrics}
    _, full, _ = _report(capsys, monkeypatch, 1000, run_id, "--db", url, "--wide", "--out",
                         str(tmp_path))
    (whole,) = _tables(full)
    code, out, _ = _report(capsys, monkeypatch, columns, run_id, "--db", url, "--wide",
                           "--out", str(tmp_path))
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns
    tables = _tables(out)
    assert len(tables) > 1
    for header in tables:  # each starts with the round, and has every round's row
        assert header[-1].split()[0] == "round"
    assert len(re.findall(r"(?m)^0\s", out)) == len(tables)
    assert len(re.findall(rf"(?m)^{ROUNDS}\s", out)) == len(tables)
    names = [n for header in tables for n in header[-1].split() if n != "round"]
    assert sorted(names) == sorted(n for n in whole[-1].split() if n != "round")
    for key in keys:  # every stored metric's column is there, under its (last) header word
        assert HEADERS.get(key, key).split("\n")[-1] in names, key


def test_noise_to_signal_is_an_essential_column(real_run, tmp_path, capsys, monkeypatch):
    url, run_id = real_run
    with Store(url) as store:
        ratio = {r.round: r.metrics.get("noise_to_signal") for r in store.rounds(run_id)}
    assert ratio[1] is not None and ratio[2] is not None
    code, out, _ = _report(capsys, monkeypatch, 80, run_id, "--db", url, "--out",
                           str(tmp_path))
    assert code == 0 and "…" not in out and max(len(x) for x in out.splitlines()) <= 80
    (header,) = _tables(out)
    names = header[-1].split()
    assert "noise/s" in names
    at = names.index("noise/s") - len(names)  # from the end: blank cells shift the start
    for rnd in (1, 2):
        row = next(line.split() for line in out.splitlines() if line.split()[:1] == [str(rnd)])
        assert row[at] == f"{ratio[rnd]:.4f}"


LONG = ("node 3112233445566778899 unreachable: Error: Message delivery failed; the "
        "destination node is offline or was never registered with this SuperLink (code 0x501)")


@pytest.mark.parametrize("columns", [120, 80, 60])
def test_long_reasons_and_node_ids_wrap_whole(tmp_path, capsys, monkeypatch, columns):
    """Deployed clients' ids are 19 digits and their reasons Flower's whole error text:
    neither is cut at any width, in the table or below each update."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    nodes = ["1112233445566778899", "2112233445566778899", "3112233445566778899"]
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0, name="deployed")
        store.record_round(run_id, round=0, model_version=0)  # the initial model: no updates
        store.record_round(run_id, round=1, model_version=1, num_sampled=3, num_replies=2,
                           num_accepted=1, num_rejected=1, num_dropped=1, updates=[
                               UpdateRecord(nodes[0], "accepted", num_examples=40, staleness=0,
                                            norm=1.25, weight=0.5),
                               UpdateRecord(nodes[1], "rejected", norm=3.5, reason=(
                                   "reply to the message sent to node 2112233445566778899 "
                                   "says it comes from node 9 [spoofed]")),
                               UpdateRecord(nodes[2], "dropped", reason=LONG)])
    code, out, _ = _report(capsys, monkeypatch, columns, run_id, "--db", url, "--updates")
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns
    flat = _flat(out)
    for node in nodes:
        assert node in out.split()  # an id never wraps
    assert _flat(LONG) in flat and "node 9 [spoofed]" in flat  # no markup eaten
    code, out, _ = _report(capsys, monkeypatch, columns, run_id, "--db", url, "--updates",
                           "--round", "0")
    assert code == 0 and "no updates recorded in round 0 of run" in _flat(out)


def test_last_reports_the_newest_run(real_run, capsys, monkeypatch, tmp_path):
    url, run_id = real_run
    code, out, _ = _report(capsys, monkeypatch, 80, "last", "--db", url, "--json")
    assert code == 0 and json.loads(out)["run"]["run"] == run_id
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    Store(empty).close()
    code, out, err = _report(capsys, monkeypatch, 80, "last", "--db", empty)
    assert code == 2 and "no runs in" in err and len(err.strip().splitlines()) == 1
