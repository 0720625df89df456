"""What several silo tests share: the scenario, the expected aggregate, the DDP worker run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.app import training_seed
from client.flat_model import FlatModel
from client.training import train
from simulations.config import load_scenario
from simulations.task import ScenarioTask

ROOT = Path(__file__).resolve().parents[2]
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
