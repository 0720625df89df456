"""The run loop knows rounds, not protocols: a round's session (``server.rounds.RoundSession``)
is stored and shown through its own ``save`` and ``shown``, whatever protocol it ran.

A round with a session of no secure aggregation writes no secure-aggregation row; a secure
round's session writes one per round and shows its survivors on the round's line.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest

from server.reporter import LogReporter
from server.store import Store
from server.sync_rounds import PlainReplies
from simulations.config import load_scenario
from tests.architecture.test_architecture_imports import ROOT, import_graph

BASE = ["federation.clients=4", "federation.rounds=2", "train.local_epochs=1"]


def _secure(name: str) -> bool:
    return "secure" in name.lower() or "secagg" in name.lower()


def test_the_run_loop_and_the_round_result_import_and_name_no_secure_aggregation() -> None:
    graph = import_graph(ROOT)
    for module in ("server.run_loop", "server.rounds"):  # type-only imports included
        assert [m for m in graph[module] if _secure(m)] == [], module
    tree = ast.parse((ROOT / "server" / "run_loop.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert sorted(n for n in names if _secure(n)) == []


class ProbeSession:
    """A round session of no protocol in particular: notes each save, shows one figure."""

    def __init__(self, saved: list[tuple[Any, str, int]]) -> None:
        self.saved = saved

    def save(self, store: Store, run_id: str, rnd: int) -> None:
        self.saved.append((store, run_id, rnd))

    def shown(self) -> dict[str, float]:
        return {"probe_figure": 7.0}


@pytest.fixture
def lines(monkeypatch) -> list[tuple[int, dict[str, float]]]:
    """The figures of each round's line, as the run loop hands them to the reporter."""
    shown: list[tuple[int, dict[str, float]]] = []
    monkeypatch.setattr(LogReporter, "round_finished",
                        lambda self, rnd, metrics: shown.append((rnd, dict(metrics))))
    return shown


def test_a_session_of_no_secure_aggregation_is_saved_and_shown_and_writes_no_secagg_row(
        run_inprocess, store, monkeypatch, lines):
    saved: list[tuple[Any, str, int]] = []
    collect = PlainReplies.collect

    def with_session(self, run_id, rnd, cohort):
        result = collect(self, run_id, rnd, cohort)
        assert result.session is None  # a plain round runs no session
        result.session = ProbeSession(saved)
        return result

    monkeypatch.setattr(PlainReplies, "collect", with_session)
    summary = run_inprocess(load_scenario("default", BASE))
    run_id = summary["run_id"]
    assert [(r, n) for _, r, n in saved] == [(run_id, 1), (run_id, 2)]  # once per round
    assert all(isinstance(s, Store) for s, _, _ in saved)
    assert [(rnd, m.get("probe_figure")) for rnd, m in lines] == [(1, 7.0), (2, 7.0)]
    assert store.secagg_rounds(run_id) == []
    assert all("probe_figure" not in r.metrics for r in store.rounds(run_id))  # shown only


def test_a_secure_round_saves_its_session_and_shows_its_survivors(run_inprocess, store, lines):
    summary = run_inprocess(load_scenario("default", [*BASE, "secagg.enabled=true"]))
    sessions = store.secagg_rounds(summary["run_id"])
    assert [(s["round"], s["status"], len(s["survivors"])) for s in sessions] == [
        (1, "completed", 4), (2, "completed", 4)]
    assert [(rnd, m["secure_survivors"], m["secure_aborted"]) for rnd, m in lines] == [
        (1, 4.0, 0.0), (2, 4.0, 0.0)]
    assert all("secure_survivors" not in r.metrics for r in store.rounds(summary["run_id"]))
