"""Real processes on 127.0.0.1: ``fedring deploy up --tls --auth``, ``flwr run``, ``deploy down``.

One deployment (a SuperLink and 3 SuperNodes with TLS and SuperNode authentication) serves
the tests in file order; the dropout test kills a SuperNode, so it comes last. The
fixture's teardown runs ``fedring deploy down`` and checks that every process the
deployment started, and everything those started, is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import server.secure_sync  # noqa: F401  the secure rounds deployed below: a broken import fails
from server.spread import spread
from server.store import Store
from simulations import deploy
from simulations.certs import write_auth_key
from simulations.task import ScenarioTask

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODES = 3
FAST = "train.local_epochs=1"

pytestmark = pytest.mark.slow


def _env(flwr_home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _fedring(args: list[str], env: dict[str, str], timeout: float = 180
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simulations.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A running TLS + auth deployment: its state, environment and a store URL."""
    tmp = tmp_path_factory.mktemp("deploy")
    env, state_dir = _env(tmp / "flwr"), tmp / "state"
    up = _fedring(["deploy", "up", "--nodes", str(NODES), "--tls", "--auth", "--dir",
                   str(state_dir), "--db", f"sqlite:///{tmp / 'store.db'}"], env)
    state = deploy.read_state(state_dir)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert "[superlink.fedring-local]" in up.stdout and "flwr run . fedring-local" in up.stdout
        pointers = json.loads((tmp / "flwr" / deploy.POINTER_FILE).read_text())
        assert pointers == {"fedring-local": str(state_dir.resolve())}  # for `down` sans --dir
        yield {"state": state, "env": env, "tmp": tmp, "state_dir": state_dir}
    finally:
        records = state["processes"] if state else []
        tree = [p for r in records if deploy.alive(r["pid"], r["start_time"])
                for p in (r["pid"], *deploy.descendants([r["pid"]]))]
        down = _fedring(["deploy", "down", "--dir", str(state_dir)], env, timeout=60)
        leftover = [p for p in tree if deploy.alive(p)]
        deploy.stop_processes(records, timeout_s=5)  # never leave anything behind
        assert down.returncode == 0, down.stderr[-2000:]
        assert not leftover, f"deploy down left {leftover} running"
        assert "fedring-local" not in (tmp / "flwr" / "config.toml").read_text()


def _flwr_run(fed: dict[str, Any], db: str, overrides: str,
              timeout: float = 240) -> subprocess.Popen:
    run_config = f'db="{db}" overrides="{overrides}"'
    return subprocess.Popen([str(BIN / "flwr"), "run", ".", "fedring-local", "--run-config",
                             run_config, "--stream"], cwd=ROOT, env=fed["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"flwr run did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _only_run(db: str) -> tuple[Any, list[Any]]:
    with Store(db) as store:
        [run] = store.list_runs()
        return run, store.rounds(run.run_id)


def test_three_rounds_with_tls_and_auth(fed: dict[str, Any]) -> None:
    """Three rounds, then every SuperNode evaluates the model on its own held-out split
    (one federated evaluation, after the last round)."""
    state = fed["state"]
    assert state["tls"] and state["auth"] and len(state["registered"]) == NODES
    assert state["node_ids"] == state["registered"]  # each node came in with its own key
    db = f"sqlite:///{fed['tmp'] / 'plain.db'}"
    _finish(_flwr_run(fed, db, f"federation.clients={NODES} federation.rounds=3 {FAST} "
                               "federation.evaluate_fraction=1 federation.evaluate_every=3"))
    run, rounds = _only_run(db)
    assert run.status == "completed"
    assert [r.round for r in rounds] == [0, 1, 2, 3]
    assert all(r.num_accepted == NODES and r.num_dropped == 0 for r in rounds[1:])
    assert rounds[-1].metrics["accuracy"] > rounds[0].metrics["accuracy"] + 0.3

    with Store(db) as store:
        evaluations = store.evaluations(run.run_id)
    assert [rnd for rnd, _ in evaluations] == [3] * NODES  # once, after the last round
    records = {e.client_id: e for _, e in evaluations}
    assert {e.fate for e in records.values()} == {"accepted"}
    task = ScenarioTask.from_config(run.config)  # supernode-i holds partition i
    held = {str(node): len(task.client_test(i)[1]) for i, node in enumerate(state["node_ids"])}
    assert {cid: e.num_examples for cid, e in records.items()} == held
    assert all(0 <= e.accuracy <= 1 and 0 <= e.loss < 10 for e in records.values())
    assert "federated_accuracy" not in rounds[1].metrics | rounds[2].metrics
    figures = spread(records.values())
    assert {k: rounds[-1].metrics[k] for k in figures} == pytest.approx(figures, abs=1e-12)
    assert figures["federated_clients"] == NODES
    assert abs(figures["federated_accuracy"] - rounds[-1].metrics["accuracy"]) < 0.15


def test_three_rounds_with_secure_aggregation(fed: dict[str, Any]) -> None:
    db = f"sqlite:///{fed['tmp'] / 'secagg.db'}"
    _finish(_flwr_run(fed, db, f"federation.clients={NODES} federation.rounds=3 {FAST} "
                               "secagg.enabled=true"))
    run, rounds = _only_run(db)
    assert run.status == "completed" and run.config["secagg"]["enabled"] is True
    assert all(r.num_accepted == NODES for r in rounds[1:])
    with Store(db) as store:
        secure = store.secagg_rounds(run.run_id)
    assert [s["round"] for s in secure] == [1, 2, 3]
    assert all(s["num_survivors"] == NODES for s in secure)


def test_supernodes_import_the_task_module_the_server_names(fed: dict[str, Any]) -> None:
    """``[task] module`` as an absolute path: every SuperNode imports the same file."""
    module = ROOT / "tests" / "simulations" / "fixtures" / "my_task.py"
    db = f"sqlite:///{fed['tmp'] / 'task.db'}"
    _finish(_flwr_run(fed, db, f"federation.clients={NODES} federation.rounds=2 {FAST} "
                               f"train.lr=0.1 task.module={module}"))
    run, rounds = _only_run(db)
    assert run.status == "completed" and run.config["task"]["module"] == str(module)
    assert all(r.num_accepted == NODES for r in rounds[1:])
    assert rounds[-1].metrics["accuracy"] > 0.9 > rounds[0].metrics["accuracy"]


def test_supernode_without_registered_key_is_refused(fed: dict[str, Any]) -> None:
    state, rogue_dir = fed["state"], fed["tmp"] / "rogue"
    key, _ = write_auth_key(rogue_dir, "rogue.auth")
    cmd = [str(BIN / "flower-supernode"), "--superlink", state["address"],
           "--root-certificates", str(Path(state["certs"]) / "ca.pem"),
           "--auth-supernode-private-key", str(key), "--node-config", "partition-id=0",
           "--host", "127.0.0.1", "--port", str(deploy.free_port()), "--isolation", "process"]
    proc = subprocess.Popen(cmd, env=fed["env"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "Failed to activate SuperNode" in out, out[-2000:]
    # the same command with a registered key is what the deployment's nodes run
    assert all(deploy.alive(r["pid"], r["start_time"]) for r in state["processes"]
               if r["name"].startswith("supernode-"))


def test_supernodes_get_their_secagg_identity(fed: dict[str, Any]) -> None:
    """Each started SuperNode's node config names its own identity key and the trusted keys,
    as flower-supernode parsed it (the nodes connected with it)."""
    from flwr.common.config import parse_config_args

    from client.secagg_identity import secagg_identity
    from privacy.secagg.identity import Identity

    certs = Path(fed["state"]["certs"])
    nodes = {r["name"]: r["cmd"] for r in fed["state"]["processes"]
             if r["name"].startswith("supernode-")}
    publics = set()
    for i in range(NODES):
        cmd = nodes[f"supernode-{i}"]
        loaded = secagg_identity(parse_config_args([cmd[cmd.index("--node-config") + 1]]))
        assert loaded is not None
        identity, trusted = loaded
        own = Identity.from_pem((certs / f"node-{i}.secagg").read_bytes())
        assert identity.public == own.public and len(trusted) == NODES
        publics.add(identity.public)
    assert publics == trusted.keys


def test_supernode_killed_mid_round_is_a_dropout(fed: dict[str, Any]) -> None:
    state = fed["state"]
    procs = {r["name"]: r for r in state["processes"]}
    node, executor = procs["supernode-2"], procs["executor-2"]
    victim = state["node_ids"][2]
    log = Path(node["log"])
    seen = log.read_text(errors="replace").count("Receiving: train message")
    os.kill(executor["pid"], signal.SIGSTOP)  # the node takes the task but cannot answer
    db = f"sqlite:///{fed['tmp'] / 'dropout.db'}"
    run = _flwr_run(fed, db, f"federation.clients={NODES} federation.min_clients=2 "
                             f"federation.rounds=1 federation.round_timeout_s=15 {FAST}")
    try:
        deadline = time.monotonic() + 180
        while log.read_text(errors="replace").count("Receiving: train message") == seen:
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the SuperNode never got its train message"
            time.sleep(0.05)
        for rec in (node, executor):  # mid-round: the message is in, no reply is out
            os.kill(rec["pid"], signal.SIGKILL)
        _finish(run)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    info, rounds = _only_run(db)
    assert info.status == "completed"
    last = rounds[-1]
    assert (last.round, last.status, last.num_sampled) == (1, "completed", NODES)
    assert (last.num_accepted, last.num_dropped) == (NODES - 1, 1)
    with Store(db) as store:
        fates = {u.client_id: u.fate for _, u in store.updates(info.run_id, round=1)}
    assert fates.pop(str(victim)) == "dropped"
    assert set(fates.values()) == {"accepted"}


def test_state_file_records_every_process(fed: dict[str, Any]) -> None:
    again = _fedring(["deploy", "up", "--dir", str(fed["state_dir"])], fed["env"])
    assert again.returncode == 1 and "still running" in again.stderr
    saved = json.loads((fed["state_dir"] / deploy.STATE_FILE).read_text())
    names = [r["name"] for r in saved["processes"]]
    assert names[0] == "superlink"
    assert sorted(names[1:]) == sorted([f"{kind}-{i}" for i in range(NODES)
                                        for kind in ("supernode", "executor")])
    assert all(isinstance(r["start_time"], int) for r in saved["processes"])
