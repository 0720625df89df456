"""The ServerApp as ``flwr run`` starts it: resolved from the run config, one line per
round on stdout (what ``flwr run --stream`` shows), clients from the connected nodes, and
a bad run config as one message."""

from __future__ import annotations

import re

from flwr.app import Context, RecordDict

from server.app import make_server_app
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.inprocess import InProcessGrid

FAST = "federation.rounds=2 train.local_epochs=1 data.partitioner=iid"


def _flwr_run(nodes: int, run_config: dict, capsys) -> list[str]:
    """Run fedring's ServerApp on ``nodes`` in-process nodes; its stdout lines."""
    app = make_server_app(build_task, config_from_run_config)
    grid = InProcessGrid(client_app, nodes)
    app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config))
    return capsys.readouterr().out.strip().splitlines()


def test_one_line_per_round_and_the_final_status_last(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    lines = _flwr_run(3, {"scenario": "default", "db": db, "overrides": FAST}, capsys)
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2, lines
    for rnd, line in enumerate(rounds, start=1):
        assert re.fullmatch(rf"round {rnd}/2: accuracy 0\.\d{{4}}, loss \d+\.\d{{4}}, "
                            r"3 accepted, 0 rejected, 0 dropped", line), line
    assert re.fullmatch(r"fedring run r\w+: completed after 2 rounds, accuracy 0\.\d{4}, "
                        rf"store sqlite:///{tmp_path}/runs\.db", lines[-1]), lines[-1]


def test_epsilon_and_the_secure_outcome_are_on_the_round_lines(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    lines = _flwr_run(4, {"scenario": "default", "db": db, "overrides": FAST,
                          "secagg.enabled": True, "dp.mode": "central",
                          "aggregation.weight_by": "uniform", "dp.noise_multiplier": 1.0},
                      capsys)
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2
    # every client every round: add/remove-one, with the replace-one figure beside it
    assert all(re.search(r", epsilon \d[\d.]* \(add/remove-one\), epsilon_replace_one "
                         r"\d[\d.]* \(replace-one\), secure sum of 4 survivors$", line)
               for line in rounds), rounds


def test_clients_are_the_connected_nodes_unless_set(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    lines = _flwr_run(3, {"scenario": "default", "db": db, "overrides": FAST}, capsys)
    assert any("3 node(s) connected, federation.clients = 3" in line for line in lines)
    assert not any("WARNING" in line for line in lines)
    with Store(db) as store:
        (run,) = store.list_runs()
        assert run.config["federation"]["clients"] == 3  # the stored, resolved value
        assert run.summary["rounds"] == 2


def test_clients_set_and_different_from_the_nodes_is_a_warning(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    lines = _flwr_run(3, {"scenario": "default", "db": db,
                          "overrides": FAST + " federation.clients=4"}, capsys)
    warning = [line for line in lines if line.startswith("WARNING")]
    assert warning and "federation.clients is 4 but 3 nodes are connected: only 3 of the 4 " \
        "partitions will train" in warning[0]
    with Store(db) as store:
        assert store.list_runs()[0].config["federation"]["clients"] == 4


def test_a_bad_override_prints_the_message_alone(tmp_path, capsys):
    db = tmp_path / "runs.db"
    lines = _flwr_run(2, {"scenario": "default", "db": f"sqlite:///{db}",
                          "overrides": "secagg.enabled=yes"}, capsys)
    assert lines == ["fedring: error: secagg.enabled must be true or false, got str 'yes'",
                     "fedring run not started: fix the run config and submit it again"]
    assert not db.exists()


def test_a_relative_db_is_made_absolute(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = _flwr_run(2, {"scenario": "default", "db": "sqlite:///sub/runs.db",
                          "overrides": FAST}, capsys)
    assert f"store sqlite:///{tmp_path}/sub/runs.db" in lines[-1]
    assert (tmp_path / "sub" / "runs.db").exists()


def test_round_lines_name_an_aborted_secure_round_and_epsilon():
    from server.reporter import round_line

    line = round_line(4, 10, {"accuracy": 0.5, "loss": 1.25, "accepted": 0.0, "rejected": 0.0,
                              "dropped": 2.0, "epsilon": 1.5, "secure_survivors": 2.0,
                              "secure_aborted": 1.0})
    assert line == ("round 4/10: accuracy 0.5000, loss 1.2500, 0 accepted, 0 rejected, "
                    "2 dropped, epsilon 1.5, secure round aborted")


def test_the_progress_line_shows_epsilon_after_every_round():
    import io

    from rich.console import Console

    from simulations.progress import RichReporter

    out = io.StringIO()
    with RichReporter(2, console=Console(file=out, width=120)) as reporter:
        reporter.round_finished(1, {"loss": 0.5, "accuracy": 0.75, "epsilon": 0.8125})
        shown = reporter.progress.tasks[0].fields["info"]
    assert "acc 0.7500" in shown and "eps 0.812" in shown


def test_the_clients_bar_is_updated_at_the_display_rate_and_at_the_last_client(monkeypatch):
    import io

    from rich.console import Console

    from simulations import progress
    from simulations.progress import RichReporter

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with RichReporter(1, console=Console(file=io.StringIO(), width=120)) as reporter:
        updates = []
        update = reporter.progress.update
        reporter.progress.update = lambda *a, **k: (updates.append(k), update(*a, **k))[1]
        reporter.round_started(1, 1000)
        updates.clear()
        for done in range(1, 1001):  # 1000 clients in 0.25 s
            clock[0] += 0.00025
            reporter.client_done(1, done, 1000)
        completed = [u["completed"] for u in updates]
        assert completed[0] == 1 and completed[-1] == 1000  # the first and the last
        assert 3 <= len(completed) <= 5  # every 0.1 s in between, not 1000 updates
        assert reporter.progress.tasks[1].completed == 1000


def test_a_run_that_crashes_ends_the_stream_with_its_status(tmp_path, capsys):
    class Crashing:
        """The scenario's task, whose evaluation breaks after the initial model's."""

        def __init__(self, config):
            self.task, self.calls = build_task(config), 0

        def __getattr__(self, name):
            return getattr(self.task, name)

        def evaluate(self, params):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("evaluation broke")
            return self.task.evaluate(params)

    db = f"sqlite:///{tmp_path / 'runs.db'}"
    app = make_server_app(Crashing, config_from_run_config)
    grid = InProcessGrid(client_app, 2)
    app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"db": db, "overrides": FAST}))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (f"fedring run failed: RuntimeError: evaluation broke (stored as failed "
                       f"in {db})")
    assert any(line.startswith("Traceback") for line in out)
    with Store(db) as store:
        assert store.list_runs()[0].status == "failed"
