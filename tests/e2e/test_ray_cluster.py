"""``--engine flower`` joins an existing Ray cluster (``engine.ray_address``) and trains the
same model as the in-process engine; Flower's deprecated Python API is not used. ``flwr run``
joins it through ``RAY_ADDRESS``."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario
from tests.e2e.conftest import SMALL
from tests.e2e.test_flwr_run import ROOT, _stop_superlinks

RAY = Path(sys.executable).parent / "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop the ``ray start --block`` process we started and every process in its own
    session (the head's GCS, raylet, workers); no other Ray process is touched."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + timeout  # the group may outlive its leader briefly
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.2)
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    """Whether any process that is not a zombie is left in process group ``pgid``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.fixture
def ray_head() -> Iterator[tuple[str, Path]]:
    """A Ray head on 127.0.0.1 with 2 CPUs, started for this test only; yields its address
    and its temp dir."""
    if not RAY.exists():
        pytest.skip("the ray CLI is not installed next to this Python")
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: socket paths
    port = _free_port()
    log = temp_dir / "start.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(port), "--ray-client-server-port", str(_free_port()),
             "--dashboard-agent-listen-port", str(_free_port()), "--num-cpus", "2",
             "--num-gpus", "0", "--temp-dir", str(temp_dir), "--include-dashboard", "false",
             "--disable-usage-stats"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 90
        while "block forever" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        _stop_group(proc)
    assert not _group_alive(proc.pid), "the Ray head's processes outlived the test"


@pytest.mark.slow
def test_flower_engine_on_a_ray_cluster_matches_inprocess(ray_head, db_url, store,
                                                          monkeypatch):
    address, temp_dir = ray_head
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = load_scenario("default", [*SMALL, f'engine.ray_address="{address}"',
                                       "engine.client_cpus=1"])
    flower_logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: flower_logs.append(record.getMessage())  # type: ignore
    logging.getLogger("flwr").addHandler(handler)
    try:
        on_ray = run_simulation(config, engine="flower", db=db_url)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    local = run_simulation(config, engine="inprocess", db=db_url)

    assert not [m for m in flower_logs if "DEPRECATED" in m], flower_logs
    # The clients ran as actors of that cluster: their logs are in its session.
    logs = list(temp_dir.glob("session_*/logs/worker-*"))
    assert any("ClientAppActor" in p.read_text(errors="replace") for p in logs), logs
    assert on_ray["versions"] == local["versions"] == 2
    # Same scenario and tolerance as tests/e2e/test_engines.py: only BLAS may differ.
    np.testing.assert_allclose(store.load_checkpoint(on_ray["run_id"]).params,
                               store.load_checkpoint(local["run_id"]).params, rtol=0, atol=1e-5)
    assert abs(on_ray["final_accuracy"] - local["final_accuracy"]) < 0.01


@pytest.mark.slow
def test_flwr_run_joins_the_cluster_through_ray_address_and_tracks(ray_head, tmp_path):
    """docs/SIMULATION.md's recipe for ``flwr run``: ``RAY_ADDRESS`` in the environment the local
    SuperLink starts from, client resources in the federation config; tracking works under
    the ServerApp too."""
    address, temp_dir = ray_head
    flwr_home = tmp_path / "flwr"
    db = f"sqlite:///{tmp_path / 'store.db'}"
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "RAY_ADDRESS": address,
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    tracked = f"tracking.tensorboard={tmp_path / 'tb'}" if _has("tensorboard") else ""
    run_config = (f'scenario="default" db="{db}" overrides="federation.rounds=1 '
                  f'federation.clients=3 train.local_epochs=1 {tracked}"')
    try:
        proc = subprocess.run(
            ["flwr", "run", ".", "local", "--stream", "--federation-config",
             "num-supernodes=3 client-resources-num-cpus=1", "--run-config", run_config],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    finally:
        _stop_superlinks(flwr_home)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with Store(db) as store:
        (run,) = store.list_runs()
        assert run.status == "completed"
    logs = list(temp_dir.glob("session_*/logs/worker-*"))
    assert any("ClientAppActor" in p.read_text(errors="replace") for p in logs), logs
    if tracked:
        assert [d.name for d in (tmp_path / "tb").iterdir()] == [run.run_id]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Every client every round: Flower's engine numbers its nodes otherwise than the in-process
# one, so drawn cohorts would differ between the two.
ON_DEMAND = ["data.dataset=synthetic", "data.partitioner=natural", "federation.clients=8",
             "data.options.num_users=8", "data.options.max_samples_per_user=60",
             "data.population=on_demand", "model.kind=logreg", "federation.rounds=2",
             "train.local_epochs=1"]


@pytest.mark.slow
def test_a_population_made_on_demand_is_made_on_the_ray_workers(ray_head, db_url, store,
                                                                monkeypatch):
    """On a Ray cluster each sampled client's data is made by the actor that trains it: the
    driver process makes none (only its central test sample), and the run ends on the
    in-process engine's model, which makes the clients here."""
    from simulations import task as task_module

    address, _ = ray_head
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = load_scenario("default", [*ON_DEMAND, f'engine.ray_address="{address}"',
                                       "engine.client_cpus=1"])
    spec = task_module.ScenarioTask.from_config(config)
    made_here = lambda: task_module._population(spec._data_json, spec.seed).cached_bytes  # noqa: E731
    task_module._population.cache_clear()
    on_ray = run_simulation(config, engine="flower", db=db_url)
    assert made_here() == 0
    local = run_simulation(config, engine="inprocess", db=db_url)
    assert made_here() > 0
    assert on_ray["versions"] == local["versions"] == 2
    np.testing.assert_allclose(store.load_checkpoint(on_ray["run_id"]).params,
                               store.load_checkpoint(local["run_id"]).params, rtol=0, atol=1e-5)
