"""What several silo tests share: the scenario, the expected aggregate, the DDP worker run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.app import training_seed
from client.flat_model import FlatModel
from client.silo.learners import train_learners
from client.training import train
from simulations import deploy
from simulations.config import load_scenario
from simulations.task import ScenarioTask

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DDP_WORKER = Path(__file__).parent / "ddp_worker.py"
SILOS = 3


def scenario(rounds: int, **values: Any) -> dict[str, Any]:
    """digits over three silos, one local epoch, cross-silo rounds."""
    return load_scenario("default", values={
        "federation.clients": SILOS, "federation.rounds": rounds, "federation.min_clients": 2,
        "train.local_epochs": 1, "driver.kind": "cross_silo", **values})


def expected_first_round(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The initial model and the weighted mean of the deltas each silo trains alone from it
    in round 1 (what the ring must produce)."""
    task = ScenarioTask.from_config(config)
    initial, _ = task.initial_params()
    deltas, weights = [], []
    for pid in range(config["federation"]["clients"]):
        model = FlatModel(task.build_model())
        model.load(initial)
        x, y = task.partition(pid)
        train(model.module, x, y, task.train_config, seed=training_seed(task.seed, 1, pid))
        deltas.append(model.flat_np - initial)
        weights.append(len(x))
    expected = np.average(np.stack(deltas), axis=0, weights=weights)
    assert np.abs(expected).max() > 1e-3  # the check below is not vacuous
    return initial, expected


def trained_silo(config: dict[str, Any], start: np.ndarray, pid: int, rnd: int) -> np.ndarray:
    """Silo ``pid``'s model after its local training from ``start`` in round ``rnd``, alone:
    ``client.training.train``, or its SMA learners when ``silo.learners`` > 1."""
    from server.cross_silo_config import SiloConfig

    task = ScenarioTask.from_config(config)
    model = FlatModel(task.build_model())
    model.load(start)
    x, y = task.partition(pid)  # the partition less the held-out split
    seed = training_seed(task.seed, rnd, pid)
    spec = SiloConfig(**config.get("silo", {})).learner_spec()
    if spec.learners > 1:
        train_learners(model.module, x, y, task.train_config, spec, seed=seed)
    else:
        train(model.module, x, y, task.train_config, seed=seed)
    return model.flat_np.copy()


def run_ddp_worker(out: Path, nproc: int, kind: str) -> dict:
    """Run ``ddp_worker.py`` under torchrun (``kind``: cpu or cuda); its JSON results."""
    # PYTHONFAULTHANDLER: a rank that crashes prints its Python stack
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(DDP_WORKER), str(out), kind],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def check_ddp_results(results: dict, tolerance: float) -> None:
    """DDP's model equals one process's on every rank, and training moved it."""
    assert set(results) == {"sgd_momentum", "adam_fedprox"}
    for name, r in results.items():
        assert r["ranks_equal"], f"{name}: the ranks' models differ"
        assert r["moved"] > 1e-2, f"{name}: training did not change the model"
        assert r["max_diff"] < tolerance, f"{name}: DDP model differs from one process: {r}"
        assert r["loss"] == pytest.approx(r["loss_alone"], rel=tolerance), name


def join_then_die(spec: dict[str, Any]) -> None:
    """A ring member that arrives and joins the group, then dies before the collective."""
    from datetime import timedelta

    import torch.distributed as dist

    from client.protocol.ring import RingSpec
    from client.silo.ring import _join

    ring = RingSpec(**spec)
    store = _join(ring)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=ring.rank,
                            world_size=ring.size, timeout=timedelta(seconds=30))
    os._exit(1)


def survivors_of_a_dead_peer(collective: Any) -> tuple[dict[int, BaseException], Any, list]:
    """Ranks 0 and 1 of a 3-rank group call ``collective(spec)`` while rank 2 joins and
    dies; the errors the survivors raised, the victim's process and the survivors' threads
    (all finished, or given up on after 120 s)."""
    import multiprocessing
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from client.protocol.ring import RingSpec

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    specs = [RingSpec(host="127.0.0.1", port=store.port, prefix="dies", rank=r, size=3,
                      join_timeout_s=30, ring_timeout_s=2) for r in range(3)]
    victim = multiprocessing.get_context("forkserver").Process(target=join_then_die,
                                                                args=(specs[2].to_dict(),))
    victim.start()
    errors: dict[int, BaseException] = {}

    def survivor(rank: int) -> None:
        try:
            collective(specs[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    victim.join(30)
    return errors, victim, threads


def _deploy_env(tmp: Path) -> dict[str, str]:
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


@contextmanager
def deployed_silos(tmp: Path, processes: Sequence[int], federation: str, *,
                   plain_nodes: int = 0) -> Iterator[dict[str, Any]]:
    """A SuperLink; for each entry of ``processes`` a SuperNode with --isolation process and
    a `fedring silo` job of that many processes behind it; then ``plain_nodes`` SuperNodes
    that serve the plain fedring ClientApp (no silo). Partition ids follow that order."""
    env, logs = _deploy_env(tmp), tmp / "logs"
    logs.mkdir()
    procs: list[dict[str, Any]] = []
    nodes = len(processes) + plain_nodes
    try:
        port = deploy.free_port()
        procs.append(deploy.launch_process("superlink", deploy.superlink_command(
            port, certs=None, auth=False), logs, env))
        _wait("the SuperLink", lambda: deploy.port_open(port), procs)
        address = f"{deploy.HOST}:{port}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLWR_HOME", env["FLWR_HOME"])
            deploy.write_federation(federation, address, None)
        opts = deploy.Options(nodes=nodes, mode="fedring")
        for i, nproc in enumerate(processes):
            runtime = deploy.free_port()
            procs.append(deploy.launch_process(f"supernode-{i}", deploy.supernode_command(
                i, address, runtime, opts, None), logs, env))
            procs.append(deploy.launch_process(f"silo-{i}", [
                sys.executable, "-m", "simulations.cli", "silo", "--nproc-per-node", str(nproc),
                "--runtime-api-address", f"{deploy.HOST}:{runtime}", "--insecure",
                "--device", "cpu", "--threads", "1", "--timeout", "60"], logs, env))
        plain = deploy.Options(nodes=nodes, mode="flower")
        for i in range(len(processes), nodes):
            procs.append(deploy.launch_process(f"plain-{i}", deploy.supernode_command(
                i, address, deploy.free_port(), plain, None), logs, env))
        _wait("the SuperNodes and silos", lambda: all(
            deploy.log_has(r["log"], "polling" if r["name"].startswith("silo")
                           else "SuperNode ID:") for r in procs[1:]), procs)
        yield {"env": env, "tmp": tmp, "procs": {r["name"]: r for r in procs}}
    finally:
        deploy.stop_processes(procs, timeout_s=5)


@contextmanager
def flwr_run(fed: dict[str, Any], federation: str, db: str,
             overrides: str) -> Iterator[subprocess.Popen]:
    """`flwr run` of fedring over a deployment (killed if it still runs at the end)."""
    run = subprocess.Popen([str(BIN / "flwr"), "run", ".", federation, "--run-config",
                            f'db="{db}" overrides="{overrides}"', "--stream"], cwd=ROOT,
                           env=fed["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def kill_silo_in_round_2(silos: dict[str, Any], run: subprocess.Popen, action: str,
                         silo: int) -> str:
    """Wait until silo ``silo``'s SuperNode received its second ``action`` message, kill
    that silo's job (torchrun, its workers and their children), and return the run's
    output once it ends, which it must do with exit status 0."""
    victim_node = silos["procs"][f"supernode-{silo}"]
    victim_silo = silos["procs"][f"silo-{silo}"]
    log = Path(victim_node["log"])
    deadline = time.monotonic() + 300
    while log.read_text(errors="replace").count(f"Receiving: {action} message") < 2:
        assert run.poll() is None, run.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "round 2 never reached the last silo"
        time.sleep(0.02)
    for pid in [victim_silo["pid"], *deploy.descendants([victim_silo["pid"]])]:
        os.kill(pid, signal.SIGKILL)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-4000:]
    return out
