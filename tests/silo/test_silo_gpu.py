"""Silos on GPUs: DDP over NCCL, silos that train on CUDA, and a cross-silo ring over NCCL."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from silo_helpers import check_ddp_results, expected_first_round, run_ddp_worker, scenario

from client.protocol.ring import RingSpec
from client.silo.app import SiloClient, make_silo_client_app
from client.silo.ring import ring_aggregate
from simulations.apps import spec_from_run_config
from simulations.silo_engine import ConcurrentGrid
from simulations.task import ScenarioTask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_ddp_over_nccl_gives_the_single_process_model(tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())
    results = run_ddp_worker(tmp_path / "ddp.json", nproc, "cuda")
    check_ddp_results(results, tolerance=1e-4)  # GPU kernels may add in another order


def test_silos_training_on_cuda_aggregate_the_weighted_mean(run_inprocess) -> None:
    config = scenario(rounds=1)
    app = make_silo_client_app(SiloClient(ScenarioTask, spec_from_run_config, device="cuda"))
    models: list[np.ndarray] = []
    summary = run_inprocess(config, grid=ConcurrentGrid(app, 3), models=models)
    assert summary["status"] == "completed"
    initial, expected = expected_first_round(config)
    np.testing.assert_allclose(models[1] - initial, expected, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL ring needs a GPU per silo")
def test_a_cross_silo_ring_over_nccl_sums_like_the_cpu() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(10_007).astype(np.float32) for _ in range(2)]
    weights = [3.0, 5.0]
    results: list = [None, None]

    def silo(rank: int) -> None:
        spec = RingSpec(host="127.0.0.1", port=store.port, prefix="gpu", rank=rank, size=2,
                        join_timeout_s=60, ring_timeout_s=30, backend="nccl")
        results[rank] = ring_aggregate(deltas[rank], weights[rank], spec, cuda_device=rank)

    threads = [threading.Thread(target=silo, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    expected = (weights[0] * deltas[0] + weights[1] * deltas[1]) / sum(weights)
    assert results[0].digest == results[1].digest
    assert results[0].total_weight == sum(weights) and results[0].count == 2
    np.testing.assert_allclose(results[0].aggregate, expected, rtol=1e-5, atol=1e-6)
