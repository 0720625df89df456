"""A SuperNode killed with SIGKILL mid-round, on real processes on 127.0.0.1: a dropout.

``fedring deploy up`` starts a SuperLink and 3 SuperNodes; ``flwr run`` runs one round.
SuperNode 2 takes its train message and is killed before it answers. Once the node has
missed its heartbeats, the SuperLink answers the message for it with an error reply of its
own; the server records the node as ``dropped`` (``node <id> unreachable: <Flower's
reason>``), not as a client whose reply claims another node, and settles the round then,
not at its deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.server.superlink.linkstate.utils import NODE_UNAVAILABLE_ERROR_REASON

from server.store import Store
from simulations import deploy

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODES = 3
ROUND_TIMEOUT_S = 150  # past Flower's heartbeat patience (2 x 30 s): the SuperLink answers

pytestmark = pytest.mark.slow


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A running deployment (no TLS): its state and environment; stopped at the end."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    state_dir = tmp_path / "state"
    up = subprocess.run([sys.executable, "-m", "simulations.cli", "deploy", "up", "--nodes",
                         str(NODES), "--dir", str(state_dir)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=180)
    state = deploy.read_state(state_dir)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield {"state": state, "env": env}
    finally:
        deploy.stop_processes(state["processes"] if state else [], timeout_s=5)


def test_a_supernode_killed_mid_round_is_dropped_as_unreachable(fed, tmp_path) -> None:
    state = fed["state"]
    procs = {r["name"]: r for r in state["processes"]}
    node, executor = procs["supernode-2"], procs["executor-2"]
    victim = state["node_ids"][2]
    log = Path(node["log"])
    os.kill(executor["pid"], signal.SIGSTOP)  # the node takes the task but cannot answer
    db = f"sqlite:///{tmp_path / 'dead.db'}"
    overrides = (f"federation.clients={NODES} federation.min_clients=2 federation.rounds=1 "
                 f"federation.round_timeout_s={ROUND_TIMEOUT_S} train.local_epochs=1")
    run = subprocess.Popen([str(BIN / "flwr"), "run", ".", "fedring-local", "--run-config",
                            f'db="{db}" overrides="{overrides}"', "--stream"], cwd=ROOT,
                           env=fed["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline = time.monotonic() + 180
        while "Receiving: train message" not in log.read_text(errors="replace"):
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the SuperNode never got its train message"
            time.sleep(0.05)
        for rec in (node, executor):  # kill -9 mid-round: the message is in, no reply out
            os.kill(rec["pid"], signal.SIGKILL)
        out, _ = run.communicate(timeout=ROUND_TIMEOUT_S + 60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, out[-3000:]
    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        updates = {u.client_id: u for _, u in store.updates(info.run_id, round=1)}
    assert info.status == "completed"
    last = rounds[-1]
    assert (last.round, last.status, last.num_sampled) == (1, "completed", NODES)
    assert (last.num_accepted, last.num_dropped, last.num_rejected) == (NODES - 1, 1, 0)
    dead = updates.pop(str(victim))
    assert dead.fate == "dropped", dead
    assert dead.reason == f"node {victim} unreachable: {NODE_UNAVAILABLE_ERROR_REASON}"
    assert {u.fate for u in updates.values()} == {"accepted"}
    assert last.wall_s < ROUND_TIMEOUT_S - 30  # settled once the SuperLink answered
    assert f"dropped client {victim}: node {victim} unreachable" in out, out[-3000:]
