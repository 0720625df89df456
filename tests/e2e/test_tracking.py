"""``[tracking]``: TensorBoard event files and MLflow runs hold the store's per-round figures,
read back with TensorBoard's and MLflow's own readers; a failing sink never fails a run."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from server.reporter import Reporter, Reporters
from simulations import tracking
from simulations.apps import client_app, server_app
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.tracking import RUN_ID_TAG, open_tracking

SMALL = ["federation.clients=4", "federation.rounds=2", "train.local_epochs=1"]
CENTRAL_DP = ["dp.mode=central", "dp.clip=1.0", "dp.noise_multiplier=0.5",
              "aggregation.weight_by=uniform"]
# What every round must show, as the store names it (epsilon: with DP on).
FIGURES = ("accuracy", "loss", "train_loss", "epsilon", "bytes_up", "bytes_down")
FATES = {"accepted": "num_accepted", "rejected": "num_rejected", "dropped": "num_dropped"}


def _config(*overrides: str) -> dict:
    return load_scenario("default", [*SMALL, *overrides])


def _stored(store, run_id: str) -> dict[str, dict[int, float]]:
    """{figure: {round: value}} of the store's rounds after round 0."""
    rounds = [r for r in store.rounds(run_id) if r.round > 0]
    out = {k: {r.round: r.metrics[k] for r in rounds} for k in FIGURES}
    out.update({fate: {r.round: float(getattr(r, col)) for r in rounds}
                for fate, col in FATES.items()})
    return out


def test_tensorboard_events_read_back_equal_the_store(tmp_path, db_url, store):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(*CENTRAL_DP, f'tracking.tensorboard="{tmp_path / "tb"}"')
    summary = run_simulation(config, engine="inprocess", db=db_url)
    run_dirs = list((tmp_path / "tb").iterdir())
    assert [d.name for d in run_dirs] == [summary["run_id"]]  # one event-file run per run
    events = EventAccumulator(str(run_dirs[0]), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()

    for figure, by_round in _stored(store, summary["run_id"]).items():
        logged = {e.step: e.value for e in events.Scalars(figure)}
        assert logged.keys() == by_round.keys() == {1, 2}, figure
        for rnd, value in by_round.items():  # TensorBoard keeps float32
            assert logged[rnd] == pytest.approx(value, rel=1e-6), (figure, rnd)
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(textwrap.dedent(text)) == json.loads(json.dumps(config))
    figures = events.Tensors("privacy_figures/text_summary")[0]
    line = figures.tensor_proto.string_val[0].decode()
    relation = store.privacy_ledger(summary["run_id"])[-1]["relation"]
    assert f"epsilon against the released model ({relation})" in line


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_mlflow_run_read_back_from_a_file_store(tmp_path, db_url, store, monkeypatch,
                                                as_uri):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read
    where = tmp_path / "mlruns"
    config = _config(*CENTRAL_DP,
                     f'tracking.mlflow="{where.as_uri() if as_uri else where}"',
                     'tracking.experiment="digits"')
    summary = run_simulation(config, engine="inprocess", db=db_url)

    client = MlflowClient(tracking_uri=where.as_uri())
    experiment = client.get_experiment_by_name("digits")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags[RUN_ID_TAG] == summary["run_id"]
    assert run.data.params["federation.clients"] == "4"
    assert run.data.params["dp.noise_multiplier"] == "0.5"
    assert run.data.params["model.hidden"] == "[64]"
    assert len(run.data.params) == len(list(tracking.flatten(config)))
    for figure, by_round in _stored(store, summary["run_id"]).items():
        history = client.get_metric_history(run.info.run_id, figure)
        assert {m.step: m.value for m in history} == by_round, figure
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert artifacts == [f"{summary['run_id']}.png"]
    ledger = store.privacy_ledger(summary["run_id"])[-1]  # the relations travel as tags
    assert run.data.tags["fedring.relation.epsilon"] == ledger["relation"]
    assert run.data.tags["fedring.against.epsilon"] == ledger["protects_against"]
    assert ("fedring.relation.epsilon_replace_one" in run.data.tags) == (
        ledger["epsilon_replace_one"] is not None)


def test_a_failing_sink_is_logged_once_and_the_run_goes_on(tmp_path, db_url, store,
                                                            monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    calls = []

    def broken_round(self, rnd, metrics):
        calls.append(rnd)
        raise OSError("No space left on device")

    monkeypatch.setattr(tracking.TensorBoardSink, "round", broken_round)
    config = _config("federation.rounds=3", f'tracking.tensorboard="{tmp_path / "tb"}"',
                     f'tracking.mlflow="{tmp_path / "mlruns"}"')
    with caplog.at_level(logging.WARNING, logger="fedring"):
        summary = run_simulation(config, engine="inprocess", db=db_url)

    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert calls == [1]  # dropped after its first failure
    failures = [r.getMessage() for r in caplog.records if "tracking to" in r.getMessage()]
    assert len(failures) == 1 and "TensorBoard" in failures[0]
    assert "No space left on device" in failures[0]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())  # the other goes on
    (run,) = client.search_runs([client.get_experiment_by_name("fedring").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accuracy")] == [1, 2, 3]


def test_a_hung_tracking_server_does_not_hold_the_run(tmp_path, db_url, monkeypatch, caplog):
    """MLflow's client retries an unreachable server for minutes: the rounds go on while
    the tracking thread waits, and the run's end waits for it only FINISH_TIMEOUT_S."""
    pytest.importorskip("mlflow")
    release = threading.Event()
    started = []

    def hangs(self, run_id, config):
        started.append(run_id)
        release.wait(60)

    monkeypatch.setattr(tracking.MlflowSink, "start", hangs)
    monkeypatch.setattr(tracking, "FINISH_TIMEOUT_S", 0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="fedring"):
            summary = run_simulation(_config("tracking.mlflow=http://127.0.0.1:9"),
                                     engine="inprocess", db=db_url)
    finally:
        release.set()
    assert summary["status"] == "completed" and started == [summary["run_id"]]
    late = [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()]
    assert len(late) == 1 and "MLflow (http://127.0.0.1:9)" in late[0]


def test_a_run_that_fails_ends_its_mlflow_run_failed(tmp_path, db_url, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from server.run_loop import RunLoop

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    finish_round = RunLoop.finish_round

    def dies_in_round_2(self, run_id, rnd, result, t0):
        if rnd == 2:
            raise RuntimeError("server lost")
        return finish_round(self, run_id, rnd, result, t0)

    monkeypatch.setattr(RunLoop, "finish_round", dies_in_round_2)
    with pytest.raises(RuntimeError, match="server lost"):
        run_simulation(_config(f'tracking.mlflow="{tmp_path / "mlruns"}"'),
                       engine="inprocess", db=db_url)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fedring").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accuracy")] == [1]


def test_the_flwr_run_server_app_tracks_too(tmp_path, db_url, store):
    """``simulations.apps.server_app`` (what ``flwr run`` loads) with the scenario and the
    tracking directory in its run config."""
    pytest.importorskip("tensorboard")
    run_config = {"db": db_url, "scenario": "default",
                  "overrides": " ".join([*SMALL, f"tracking.tensorboard={tmp_path / 'tb'}"])}
    grid = InProcessGrid(client_app, 4)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                             run_config=run_config))
    (run,) = store.list_runs()
    assert [d.name for d in (tmp_path / "tb").iterdir()] == [run.run_id]


@pytest.mark.parametrize(("key", "module"), [("tensorboard", "tensorboard"),
                                             ("mlflow", "mlflow")])
def test_a_missing_extra_fails_at_start_saying_what_to_install(key, module, tmp_path, db_url,
                                                               store, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    config = _config(f'tracking.{key}="{tmp_path / "t"}"')
    with pytest.raises(ValueError, match=rf"tracking\.{key} .*pip install 'fedring\[tracking\]'"):
        run_simulation(config, engine="inprocess", db=db_url)
    with pytest.raises(ValueError, match=r"pip install 'fedring\[tracking\]'"):
        open_tracking(config, db_url)  # the ServerApp's check, under flwr run
    assert store.list_runs() == []
    assert not Path(tmp_path / "t").exists()


def test_tracking_is_off_by_default():
    assert open_tracking(load_scenario("default"), "sqlite://") is None


def test_reporters_pass_every_hook_on():
    hooks = sorted(n for n in vars(Reporter) if not n.startswith("_"))
    assert hooks and all(n in vars(Reporters) for n in hooks)
    seen: list[tuple] = []

    class Recorder(Reporter):
        def __getattribute__(self, name):
            if name in hooks:
                return lambda *args: seen.append((id(self), name, args))
            return object.__getattribute__(self, name)

    a, b = Recorder(), Recorder()
    fan = Reporters(a, b)
    for name in hooks:
        getattr(fan, name)(*(["x"] * (getattr(Reporter, name).__code__.co_argcount - 1)))
    assert [(who, name) for who, name, _ in seen] == [
        (id(r), name) for name in hooks for r in (a, b)]


def test_federated_figures_reach_tensorboard_and_mlflow_on_the_rounds_that_evaluated(
        tmp_path, db_url, store, monkeypatch):
    """FedBN on the feature-shift scenario, evaluating on the clients every 2nd round and
    after the last: the global and personal figures, under their store names, read back
    from the event file and the MLflow store equal the store's on rounds 2 and 3 only; the
    TensorBoard layout charts the spread as a margin (mean, p10, p90)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from server.spread import accuracy_key

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = load_scenario("feature_shift", [
        "federation.clients=4", "federation.rounds=3", "train.local_epochs=1",
        "federation.evaluate_every=2", "aggregation.local_buffers=true",
        f'tracking.tensorboard="{tmp_path / "tb"}"', f'tracking.mlflow="{tmp_path / "ml"}"'])
    summary = run_simulation(config, engine="inprocess", db=db_url)
    rounds = {r.round: r.metrics for r in store.rounds(summary["run_id"]) if r.round > 0}
    keys = [accuracy_key(stat, personal=personal) for personal in (False, True)
            for stat in (None, "mean", "std", "p10", "p90", "min")]
    keys += ["federated_loss", "federated_loss_personal", "federated_clients"]
    stored = {k: {rnd: m[k] for rnd, m in rounds.items() if k in m} for k in keys}
    assert all(by_round.keys() == {2, 3} for by_round in stored.values()), stored
    assert stored["federated_clients"] == {2: 4.0, 3: 4.0}

    events = EventAccumulator(str(tmp_path / "tb" / summary["run_id"]),
                              size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    client = MlflowClient(tracking_uri=(tmp_path / "ml").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fedring").experiment_id])
    for key, by_round in stored.items():
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged == pytest.approx(by_round, rel=1e-6), key  # TensorBoard keeps float32
        history = client.get_metric_history(run.info.run_id, key)
        assert {m.step: m.value for m in history} == by_round, key

    (written,) = events.Tensors("custom_scalars__config__")  # once, at the first evaluation
    layout = layout_pb2.Layout()
    layout.ParseFromString(written.tensor_proto.string_val[0])
    (category,) = layout.category
    margins = [c.margin.series[0] for c in category.chart if c.HasField("margin")]
    assert [(s.value, s.lower, s.upper) for s in margins] == [
        (accuracy_key("mean", personal=p), accuracy_key("p10", personal=p),
         accuracy_key("p90", personal=p)) for p in (False, True)]
    lines = [list(c.multiline.tag) for c in category.chart if c.HasField("multiline")]
    assert lines[0] == ["^federated_accuracy$", "^federated_accuracy_min$", "^accuracy$"]
