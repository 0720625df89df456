"""How a run ends: stopped after rounds that apply nothing, with the reason stored and
printed last; a resumed run's time for its own part and for the whole run."""

from __future__ import annotations

import pytest

from server.reporter import LogReporter
from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario

FAST = ["federation.clients=3", "train.local_epochs=1", "data.partitioner=iid"]
ALL_REJECTED = "aggregation.max_norm=1e-9"  # every delta is over the bound


def test_a_run_whose_every_update_is_rejected_stops_and_says_why(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=8", ALL_REJECTED])
    summary = run_simulation(config, engine="inprocess", db=db)
    assert summary["status"] == "failed" and summary["rounds"] == 3
    reason = summary["stop_reason"]
    assert reason.startswith("stopped before round 4: 3 consecutive rounds applied no update "
                             "(federation.max_failed_rounds = 3); the last: ")
    assert "no update was accepted" in reason and "exceeds max_norm" in reason
    with Store(db) as store:
        (run,) = store.list_runs()
        assert run.status == "failed" and run.summary["stop_reason"] == reason
        assert run.num_rounds == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"fedring run {summary['run_id']}: failed after 3 rounds")
    assert last.endswith(reason)


def test_the_limit_counts_consecutive_rounds_and_zero_turns_it_off(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=4", ALL_REJECTED,
                                       "federation.max_failed_rounds=0"])
    summary = run_simulation(config, engine="inprocess", db=db)
    assert summary["rounds"] == 4 and "stop_reason" not in summary
    config = load_scenario("default", [*FAST, "federation.rounds=3",
                                       "federation.max_failed_rounds=1"])
    assert run_simulation(config, engine="inprocess", db=db)["status"] == "completed"


def test_max_failed_rounds_must_not_be_negative():
    with pytest.raises(ValueError, match=r"federation\.max_failed_rounds must be >= 0"):
        load_scenario("default", ["federation.max_failed_rounds=-1"])


class _Interrupt(LogReporter):
    """Stops the server process after round 2, as a crash would."""

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        super().round_finished(rnd, metrics)
        if rnd == 2:
            raise KeyboardInterrupt


def test_a_resumed_run_reports_its_part_and_the_whole_runs_wall_time(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=3"])
    with pytest.raises(KeyboardInterrupt):
        run_simulation(config, engine="inprocess", db=db, reporter=_Interrupt())
    with Store(db) as store:
        (run,) = store.list_runs()
        before = sum(r.wall_s for r in store.rounds(run.run_id))
    summary = run_simulation(config, engine="inprocess", db=db, resume=run.run_id)
    assert summary["resumed_after_round"] == 2 and summary["rounds"] == 3
    assert before > 0 and summary["wall_s"] > 0
    assert summary["wall_s_total"] == pytest.approx(before + summary["wall_s"], abs=2e-3)
    with Store(db) as store:
        stored = store.get_run(run.run_id).summary
    assert stored["wall_s"] == summary["wall_s"]
    assert stored["wall_s_total"] == summary["wall_s_total"]


def test_a_target_the_initial_model_meets_stops_the_run_without_calling_it_failed(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    config = load_scenario("default", [*FAST, "federation.rounds=3",
                                       "driver.target_accuracy=0.01"])
    summary = run_simulation(config, engine="inprocess", db=db)
    assert summary["rounds"] == 0 and summary["status"] == "stopped"
    assert summary["stop_reason"] == ("stopped before round 1: the initial model already "
                                      "reaches driver.target_accuracy")
