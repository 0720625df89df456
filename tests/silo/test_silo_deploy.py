"""Silos as real processes: a SuperLink, SuperNodes, `fedring silo` jobs and `flwr run`.

One silo runs two processes (DDP inside), the other one. Round 1 aggregates over the ring
of both, and the server applies exactly the weighted mean of what each silo would train
alone. The second silo is then killed (its whole torchrun job, SIGKILL) as its SuperNode
receives the round-2 message, and round 2 fails once the first gives up on it. Before
that, a secure run over the same silos sums masked updates over the ring.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from silo_helpers import expected_first_round

from server.store import Store
from simulations import deploy

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROCESSES = (2, 1, 1)  # per silo; three: a secure sum needs secagg.min_survivors = 3
SILOS = len(PROCESSES)
FEDERATION = "fedring-silos"

pytestmark = pytest.mark.slow


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(tmp / "flwr"), "OMP_NUM_THREADS": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
            "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _wait(what: str, ready: Any, procs: list[dict[str, Any]], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [r["name"] for r in procs if not deploy.alive(r["pid"])]
        assert not dead, f"{dead} exited while waiting for {what}: " + "\n".join(
            Path(r["log"]).read_text(errors="replace")[-2000:] for r in procs
            if r["name"] in dead)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def silos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A SuperLink, SuperNodes with --isolation process, and a `fedring silo` per node."""
    tmp = tmp_path_factory.mktemp("silos")
    env, logs = _env(tmp), tmp / "logs"
    logs.mkdir()
    procs: list[dict[str, Any]] = []
    try:
        port = deploy.free_port()
        procs.append(deploy.launch_process("superlink", deploy.superlink_command(
            port, certs=None, auth=False), logs, env))
        _wait("the SuperLink", lambda: deploy.port_open(port), procs)
        address = f"{deploy.HOST}:{port}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLWR_HOME", env["FLWR_HOME"])
            deploy.write_federation(FEDERATION, address, None)
        opts = deploy.Options(nodes=SILOS, mode="fedring")
        for i, nproc in enumerate(PROCESSES):
            runtime = deploy.free_port()
            procs.append(deploy.launch_process(f"supernode-{i}", deploy.supernode_command(
                i, address, runtime, opts, None), logs, env))
            procs.append(deploy.launch_process(f"silo-{i}", [
                sys.executable, "-m", "simulations.cli", "silo", "--nproc-per-node", str(nproc),
                "--runtime-api-address", f"{deploy.HOST}:{runtime}", "--insecure",
                "--device", "cpu", "--threads", "1", "--timeout", "60"], logs, env))
        _wait("the SuperNodes and silos", lambda: all(
            deploy.log_has(r["log"], "SuperNode ID:" if r["name"].startswith("supernode")
                           else "polling") for r in procs[1:]), procs)
        yield {"env": env, "tmp": tmp, "procs": {r["name"]: r for r in procs}}
    finally:
        deploy.stop_processes(procs, timeout_s=5)


def _train_messages(log: str) -> int:
    return Path(log).read_text(errors="replace").count("Receiving: train.cross_silo message")


@contextmanager
def _flwr_run(silos: dict[str, Any], db: str, rounds: int,
              extra: str) -> Iterator[subprocess.Popen]:
    """`flwr run` of a cross-silo run over the silos (killed if it still runs at the end)."""
    overrides = (f"federation.clients={SILOS} federation.min_clients={SILOS} "
                 f"federation.rounds={rounds} federation.round_timeout_s=120 "
                 f"train.local_epochs=1 driver.kind=cross_silo silo.join_timeout_s=10 {extra}")
    run = subprocess.Popen([str(BIN / "flwr"), "run", ".", FEDERATION, "--run-config",
                            f'db="{db}" overrides="{overrides}"', "--stream"], cwd=ROOT,
                           env=silos["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def test_real_silos_sum_masked_updates_over_the_ring(silos: dict[str, Any]) -> None:
    """SecAgg+ across the real silos: masked words through the ring, the plain mean out."""
    db = f"sqlite:///{silos['tmp'] / 'secure.db'}"
    with _flwr_run(silos, db, 1, "silo.ring_timeout_s=30 secagg.enabled=true") as run:
        out, _ = run.communicate(timeout=300)
    # `flwr run --stream` exits 0 even when the ServerApp raises: the store says how it went
    assert run.returncode == 0, out[-4000:]

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        model = store.load_checkpoint(info.run_id, round=1)
        [secure] = store.secagg_rounds(info.run_id)
    assert info.config["secagg"]["enabled"] and info.config["driver"]["kind"] == "cross_silo"
    assert [r.status for r in rounds] == ["completed", "completed"], out[-4000:]
    assert rounds[1].metrics["ring_count"] == SILOS
    assert secure["status"] == "completed" and secure["num_survivors"] == SILOS
    initial, expected = expected_first_round(info.config)
    # each silo rounds its weighted update to the fixed-point grid (far below 1e-5 here)
    np.testing.assert_allclose(model.params - initial, expected, atol=1e-5)


def test_real_silos_aggregate_over_the_ring_and_a_killed_silo_fails_the_round(
        silos: dict[str, Any]) -> None:
    db = f"sqlite:///{silos['tmp'] / 'silos.db'}"
    victim_node = silos["procs"][f"supernode-{SILOS - 1}"]
    victim_silo = silos["procs"][f"silo-{SILOS - 1}"]
    with _flwr_run(silos, db, 2, "silo.ring_timeout_s=3") as run:
        deadline = time.monotonic() + 300
        while _train_messages(victim_node["log"]) < 2:  # round 2's message is in
            assert run.poll() is None, run.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "round 2 never reached the last silo"
            time.sleep(0.02)
        for pid in [victim_silo["pid"], *deploy.descendants([victim_silo["pid"]])]:
            os.kill(pid, signal.SIGKILL)  # torchrun, its worker and the worker's children
        out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-4000:]

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        first_model = store.load_checkpoint(info.run_id, round=1)
        updates = {u.client_id: u for _, u in store.updates(info.run_id, round=2)}
    assert info.config["driver"]["kind"] == "cross_silo"
    assert [r.status for r in rounds] == ["completed", "completed", "failed"], out[-4000:]
    first, second = rounds[1:]
    assert first.num_accepted == SILOS and first.metrics["ring_count"] == SILOS
    initial, expected = expected_first_round(info.config)
    np.testing.assert_allclose(first_model.params - initial, expected, atol=1e-5)

    assert second.model_version == first.model_version  # the model is unchanged
    victim = next(cid for cid, u in updates.items() if u.fate == "dropped")
    assert "hung or died" in updates[victim].reason
    others = [u for cid, u in updates.items() if cid != victim]
    assert len(others) == SILOS - 1
    assert all("did not join" in u.reason for u in others), [u.reason for u in others]
