"""Secure clients that quantize and mask on several threads (node config ``mask-threads``)
send the same vectors as on one, and the engines give their nodes the right count."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs

from client.protocol.keys import NodeConfigKey
from client.secure_client import mask_threads
from privacy.secagg.prg import PARALLEL_WORDS
from privacy.secagg.quantize import PARALLEL_COORDS
from privacy.secagg.workers import default_threads, worker_cpu_seconds
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid
from simulations.silo_engine import ConcurrentGrid
from tests.shared_chunks import every_thread_works

N = 4  # k = 3: one self-mask and three pair masks per client
DIM = max(PARALLEL_COORDS, PARALLEL_WORDS // (N + 1)) + 1000  # large enough for threads


def _round(inputs, threads: int, rounding: str):
    app = synthetic_app(inputs)
    client_workers: list[float] = []

    def timed(msg, context):  # worker CPU the clients waited for (the server's is apart)
        before = worker_cpu_seconds()
        try:
            return app(msg, context)
        finally:
            client_workers.append(worker_cpu_seconds() - before)

    arrays, config = empty_model()
    grid = InProcessGrid(timed, N, mask_threads=threads)  # type: ignore[arg-type]
    settings = SecAggScenarioConfig(enabled=True, clip_range=1.0, max_weight=100.0,
                                    rounding=rounding)
    session = SecAggSession(grid, settings, "examples", 3, 30.0, 0.001)
    out = session.run(list(inputs), 1, TrainStart(arrays, config, DIM))
    assert out.status == "completed", out.abort_reason
    return out, sum(client_workers)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_round_with_clients_on_threads_sums_as_on_one_thread(rounding, monkeypatch):
    inputs = synthetic_inputs(N, DIM)
    every_thread_works(monkeypatch)  # no pool thread left out by starting late
    one, one_workers = _round(inputs, 1, rounding)
    many, many_workers = _round(inputs, 3, rounding)
    assert one_workers == 0  # one thread: nothing handed to the workers
    assert many_workers > 0  # the clients' quantizing and masking ran on worker threads
    np.testing.assert_array_equal(many.weighted_sum, one.weighted_sum)
    assert many.total_weight == one.total_weight
    total = sum(min(e, 100.0) * np.clip(d.astype(np.float64), -1, 1) for d, e in inputs.values())
    np.testing.assert_allclose(many.weighted_sum, total, rtol=0, atol=N / many.scale)


def _context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(),
                   run_config={})


@pytest.mark.parametrize("value", [0, -2, "4", 2.0, True])
def test_a_bad_mask_threads_node_config_is_refused_with_its_name(value):
    with pytest.raises(ValueError, match="'mask-threads' must be an integer >= 1"):
        mask_threads(_context({NodeConfigKey.MASK_THREADS: value}))


def test_mask_threads_defaults_to_one_and_takes_the_node_config():
    assert mask_threads(_context({})) == 1
    assert mask_threads(_context({NodeConfigKey.MASK_THREADS: 6})) == 6


def test_engines_give_sequential_nodes_the_cores_and_concurrent_ones_one_thread():
    def app(msg, context):
        raise AssertionError("not called")

    def threads_of(grid: InProcessGrid) -> set[int]:
        return {c.node_config[NodeConfigKey.MASK_THREADS] for c in grid._contexts.values()}

    assert threads_of(InProcessGrid(app, 3)) == {default_threads()}
    assert threads_of(InProcessGrid(app, 3, mask_threads=2)) == {2}
    assert threads_of(ConcurrentGrid(app, 3)) == {1}
    assert 1 <= default_threads() <= 8


def test_worker_cpu_is_counted_per_calling_thread():
    from concurrent.futures import ThreadPoolExecutor

    from privacy.secagg import workers

    def spin() -> int:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return 1

    before = worker_cpu_seconds()
    with ThreadPoolExecutor(1) as other:  # another caller's workers are not ours
        assert other.submit(lambda: workers.run([spin, spin, spin])).result() == [1, 1, 1]
    assert worker_cpu_seconds() == before
    started = time.thread_time()
    assert workers.run([spin, spin, spin]) == [1, 1, 1]
    assert time.thread_time() - started >= 0.02  # the first job ran in this thread
    assert worker_cpu_seconds() - before >= 0.035  # the other two on the pool


def test_a_failing_job_is_raised_once_every_job_has_ended():
    from privacy.secagg import workers

    ended: list[int] = []

    def slow() -> None:
        time.sleep(0.05)
        ended.append(1)

    def fail() -> None:
        raise RuntimeError("span failed")

    with pytest.raises(RuntimeError, match="span failed"):
        workers.run([fail, slow])
    assert ended == [1]  # it did not return while a job still wrote
    with pytest.raises(RuntimeError, match="span failed"):
        workers.run([slow, fail])
