"""Seconds per warm round: a bare torch loop, fedring's in-process engine, Flower's Ray engine.

One workload for all three (digits, IID partitions, MLP, 1 local epoch, batch 32, SGD
lr 0.05 without momentum, every client every round, same seeds and batches):

(a) bare: one torch model whose parameters are views of one flat tensor; for each
    client, copy the global weights in, run ``client.training.train``, subtract, add the
    weighted delta to a running sum; then apply the mean. No framework, no evaluation.
(b) fedring: ``simulations.cli.run_simulation`` with the in-process engine (the real
    ServerApp and ClientApp), SQLite store in a temporary folder, default settings (a
    checkpoint every round). A round is timed from one ``round_finished`` report to the
    next, so it includes the store writes. The server's central evaluation (360 test
    images) is timed by wrapping ``ScenarioTask.evaluate`` and subtracted ("net"); the
    raw period and the store's own ``wall_s`` (which stops before the store writes) are
    reported too. The checkpoint is written on the store's writer thread while the next
    round runs; here the lockstep bare round waits for that write first (so it runs
    undisturbed), and the wait is reported as ``fedring_checkpoint_write_s``: what a
    round would pay on top if no core were free for the writer (it is not charged).
(c) flower: ``flwr.simulation.run_simulation`` (Ray, 1 CPU per actor) with Flower's own
    ``FedAvg`` (no evaluation) driving fedring's ClientApp, which replies with full
    weights there; a round is timed between ``evaluate_fn`` calls. The ClientApp gets the
    scenario through a small wrapper that puts it in ``context.run_config``, as
    ``flwr run`` would.

Load on a shared machine drifts, so (a) runs in lockstep: one bare round right after each
round of (b) (in the reporter's ``round_finished``) and of (c) (in ``evaluate_fn``),
outside their timed spans. Overheads are medians of these paired warm rounds; the first
round of every run is a warm-up and is dropped. (c) runs between the runs of (b), and
Flower's ratio to fedring is given twice: of the median rounds (``flower_over_fedring``)
and of each engine's round in units of the bare round beside it
(``flower_over_fedring_per_bare``), which cancels a load change between the two. Every
engine must end with the bare loop's model (up to float rounding): the largest
difference is reported as a check.

Cold start: wall time from spawning a fresh interpreter to the end of round 1, for (a)
and for (b) through ``run_simulation``, alternated, median.

A batch-norm CNN at CIFAR shape (``--cifar-bn``, or ``--cifar-bn-only``): the ``cifar10``
scenario's ResNet-style model (3x32x32, batch norm, 0.31M parameters and 1,344 float
buffers) on generated images written as CIFAR-10 python batches, IID over 100 clients
(quick: 4 clients and width 8), 16 images each, one local epoch of batch 16, (a) and (b)
in lockstep as above; the bare loop averages batch norm's statistics with the weights,
as fedring does by default.

pfl-research's workload (``pfl_workload.py``): a pfl-style bare loop, fedring (also with
vectorized cohorts) and, given ``--pfl-python`` (an interpreter with ``pfl[pytorch]``),
pfl 0.6 itself, alternated ``--pfl-reps`` times, each as a ratio to the bare loop of the
same repetition; without ``--pfl-python`` pfl is skipped with a note.

    python benchmarks/simulation_overhead.py [--quick] [--reps R] [--no-flower]
                                             [--sizes 10x10k,100x1m] [--no-cold]
                                             [--cifar-bn | --cifar-bn-only]
                                             [--pfl-python PATH] [--pfl-reps 7]
                                             [--fedring-baseline TREE]
                                             [--memory-users 1000,3000,10000]
                                             [--pfl-workload-only | --no-pfl-workload]
    python benchmarks/simulation_overhead.py --cohort-sizes 100,10000 [--cohort-rounds 3]

Cohort sizes (``--cohort-sizes``): every client of a population of N every round, the
10k-parameter MLP on generated data of 18 examples a client (an npz data set, one user a
client), fedring beside the lockstep bare loop; the per-client overhead at each N.

Large populations (``population_memory.py``): the peak memory of loading FedProx
Synthetic with one user per client, per client count.

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from harness import WHOLE_PARTITIONS, log
from machine_info import load_average, machine
from pfl_workload import compare as pfl_compare
from pfl_workload import pfl_targets
from population_memory import measure as population_memory

SMALL, LARGE = [128], [1024, 1024]  # 9,610 and 1,126,410 parameters on digits
HIDDEN = {"10k": SMALL, "1m": LARGE}
FULL_SIZES = [(10, SMALL), (100, SMALL), (10, LARGE), (100, LARGE)]
QUICK_SIZES = [(4, SMALL)]
WORKLOAD = {**WHOLE_PARTITIONS,
            "data.partitioner": "iid", "train.local_epochs": 1, "train.batch_size": 32,
            "train.lr": 0.05, "train.optimizer": "sgd", "train.momentum": 0.0}
TARGET_PER_CLIENT_MS = 2.0
TARGET_FLOWER_RATIO = 3.0
TARGET_COLD_S = 0.5
START_ENV = dict(os.environ)  # Ray's start edits PYTHONPATH; cold starts get the original


def scenario(clients: int, hidden: list[int], rounds: int) -> dict[str, Any]:
    """The default scenario with the common workload."""
    from simulations.config import load_scenario

    return load_scenario("default", values={**WORKLOAD, "model.hidden": list(hidden),
                                            "federation.clients": clients,
                                            "federation.rounds": rounds})


def training_seed(seed: int, server_round: int, partition_id: int) -> int:
    """Same per-client seed as ``client.app.training_seed`` (copied: no flwr import here)."""
    digest = hashlib.sha256(f"{seed}:{server_round}:{partition_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def r4(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.4g}")


# --------------------------------------------------------------------------- (a) bare loop


class BareLoop:
    """The bare sequential loop; ``run_round`` trains every client once and applies the mean."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from client.training import train
        from simulations.task import ScenarioTask

        self._torch, self._train = torch, train
        self.task = ScenarioTask.from_config(config)
        self.module = self.task.build_model()
        # Parameters and floating-point buffers (batch norm's statistics), in state-dict
        # order as fedring's layout has them; integer buffers (batch counts) stay out.
        params = [t for t in self.module.state_dict(keep_vars=True).values()
                  if t.is_floating_point()]
        self.flat = torch.empty(sum(p.numel() for p in params))
        off = 0
        with torch.no_grad():
            for p in params:  # they become views of ``flat``: loading is one copy
                view = self.flat[off:off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                off += p.numel()
        self.global_w = self.flat.clone()
        self.delta, self.acc = torch.empty_like(self.flat), torch.empty_like(self.flat)
        self.data: dict[int, tuple[Any, Any]] = {}

    def run_round(self, rnd: int) -> float:
        """Seconds for round ``rnd`` (the first one also loads the partitions)."""
        torch, task = self._torch, self.task
        t0 = time.perf_counter()
        self.acc.zero_()
        total = 0.0
        for pid in range(task.clients):
            if pid not in self.data:
                self.data[pid] = task.partition(pid)
            x, y = self.data[pid]
            self.flat.copy_(self.global_w)
            self._train(self.module, x, y, task.train_config,
                        seed=training_seed(task.seed, rnd, pid))
            with torch.no_grad():
                torch.sub(self.flat, self.global_w, out=self.delta)
                self.acc.add_(self.delta, alpha=float(len(x)))
            total += len(x)
        with torch.no_grad():
            self.global_w.add_(self.acc.mul_(1.0 / total))
        return time.perf_counter() - t0

    def final(self) -> Any:
        return self.global_w.numpy()


# --------------------------------------------------------------------------- (b) fedring


def run_fedring(config: dict[str, Any], folder: str) -> dict[str, Any]:
    """fedring's in-process engine, with a bare round after each of its rounds."""
    import numpy as np

    from server.reporter import Reporter
    from server.store import Store
    from simulations.cli import run_simulation
    from simulations.task import ScenarioTask

    bare = BareLoop(config)
    stores: list[Store] = []  # the run's store, to wait for its background checkpoint

    class Lockstep(Reporter):
        def __init__(self) -> None:
            self.start = math.nan
            self.period: list[float] = []
            self.bare: list[float] = []
            self.write: list[float] = []

        def run_started(self, run_id: str, config: dict[str, Any]) -> None:
            self.start = time.perf_counter()  # after the round-0 evaluation

        def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
            self.period.append(time.perf_counter() - self.start)  # after the store writes
            t0 = time.perf_counter()
            for store in stores:
                store.flush()
            self.write.append(time.perf_counter() - t0)
            self.bare.append(bare.run_round(rnd))
            self.start = time.perf_counter()

    eval_s: list[float] = []
    last: list[np.ndarray] = []
    evaluate = ScenarioTask.evaluate

    def timed_evaluate(task: ScenarioTask, params: np.ndarray) -> dict[str, float]:
        t0 = time.perf_counter()
        out = evaluate(task, params)
        eval_s.append(time.perf_counter() - t0)
        last[:] = [params]  # updated in place by the server: ends as the final model
        return out

    save = Store.save_checkpoint_in_background

    def noted_save(store: Store, *args: Any, **kwargs: Any) -> None:
        stores[:] = [store]
        save(store, *args, **kwargs)

    url = f"sqlite:///{os.path.join(folder, f'fedring-{time.time_ns()}.db')}"
    rep = Lockstep()
    ScenarioTask.evaluate = timed_evaluate  # type: ignore[method-assign]
    Store.save_checkpoint_in_background = noted_save  # type: ignore[method-assign]
    try:
        summary = run_simulation(config, engine="inprocess", db=url, reporter=rep)
    finally:
        ScenarioTask.evaluate = evaluate  # type: ignore[method-assign]
        Store.save_checkpoint_in_background = save  # type: ignore[method-assign]
    with Store(url) as store:
        wall = [r.wall_s for r in store.rounds(summary["run_id"]) if r.round > 0]
    rounds = config["federation"]["rounds"]
    if len(rep.period) != rounds or len(eval_s) != rounds + 1:
        raise RuntimeError(f"fedring ran {len(rep.period)} of {rounds} rounds")
    return {"period": rep.period, "bare": rep.bare, "store_wall": wall, "eval": eval_s[1:],
            "write": rep.write, "diff": float(np.abs(last[0] - bare.final()).max())}


# ------------------------------------------------------------- cohorts of 100 to 10,000


COHORT_PER_CLIENT = 18  # examples a client, as digits over 100 clients
COHORT_FEATURES = 64


def cohort_data(clients: int, folder: str) -> str:
    """An npz data set of ``clients`` users of ``COHORT_PER_CLIENT`` examples each (user i's
    rows grouped as i): the same per-client work at every cohort size."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = clients * COHORT_PER_CLIENT
    w = rng.standard_normal((COHORT_FEATURES, 10)).astype(np.float32)
    x = rng.standard_normal((n, COHORT_FEATURES)).astype(np.float32)
    x_test = rng.standard_normal((360, COHORT_FEATURES)).astype(np.float32)
    path = os.path.join(folder, f"cohort-{clients}.npz")
    np.savez(path, x_train=x, y_train=(x @ w).argmax(1), x_test=x_test,
             y_test=(x_test @ w).argmax(1), groups=np.repeat(np.arange(clients),
                                                              COHORT_PER_CLIENT))
    return path


def cohort_overhead(sizes: list[int], rounds: int, folder: str) -> dict[str, Any]:
    """fedring's per-client overhead over the lockstep bare loop, every client of a
    population of N every round, 10k parameters (64-128-10), at each N of ``sizes``."""
    from simulations.config import load_scenario

    rows = []
    for clients in sizes:
        config = load_scenario("default", values={
            **WORKLOAD, "data.dataset": "npz", "data.partitioner": "natural",
            "data.options": {"path": cohort_data(clients, folder)}, "model.hidden": SMALL,
            "federation.clients": clients, "federation.rounds": rounds})
        run = run_fedring(config, folder)
        net = [p - e for p, e in zip(run["period"][1:], run["eval"][1:], strict=True)]
        over = [(x - y) / clients * 1e3 for x, y in zip(net, run["bare"][1:], strict=True)]
        bare = median(run["bare"][1:])
        rows.append({"clients": clients, "rounds": rounds, "bare_s": r4(bare),
                     "fedring_s": r4(median(net)), "ratio": r4(median(net) / bare),
                     "fedring_over_bare_ms_per_client": r4(median(over)),
                     "fedring_over_bare_ms_per_client_each": [r4(x) for x in over],
                     "bare_ms_per_client": r4(bare / clients * 1e3),
                     "fedring_vs_bare_max_abs_diff": float(f"{run['diff']:.3g}")})
        log(f"cohort N={clients:,}: bare {rows[-1]['bare_s']} s/round, fedring "
            f"{rows[-1]['fedring_s']} s (net of evaluation): +"
            f"{rows[-1]['fedring_over_bare_ms_per_client']} ms/client; model max |diff| "
            f"{rows[-1]['fedring_vs_bare_max_abs_diff']}")
    small, large = rows[0], rows[-1]
    return {"rows": rows, "target_overhead_at_largest_not_above_smallest": {
        "met": large["fedring_over_bare_ms_per_client"]
        <= small["fedring_over_bare_ms_per_client"],
        "smallest": small["fedring_over_bare_ms_per_client"],
        "largest": large["fedring_over_bare_ms_per_client"]}}


# --------------------------------------------------------------------------- (c) Flower


def flower_client_app(run_config: dict[str, Any]) -> Any:
    """fedring's ClientApp, given the scenario through ``context.run_config``.

    ``flwr.simulation.run_simulation`` gives ClientApps an empty run config; under
    ``flwr run`` it would hold these keys.
    """
    from flwr.app import Context
    from flwr.clientapp import ClientApp

    from simulations.apps import client_app

    app = ClientApp()

    @app.train()
    def train(msg: Any, context: Context) -> Any:
        # Flower refuses a changed run_config on the way back: hand the app a copy.
        return client_app(msg, Context(run_id=context.run_id, node_id=context.node_id,
                                       node_config=context.node_config, state=context.state,
                                       run_config={**context.run_config, **run_config}))

    return app


def run_flower(config: dict[str, Any]) -> dict[str, Any]:
    """Flower's FedAvg on its Ray engine, with a bare round after each of its rounds."""
    import logging

    import numpy as np
    from flwr.app import ArrayRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    n, rounds = config["federation"]["clients"], config["federation"]["rounds"]
    bare = BareLoop(config)
    period: list[float] = []
    bare_s: list[float] = []
    start: list[float] = []
    diff: list[float] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Any, context: Any) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n,
                          min_available_nodes=n)

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> None:
            if rnd > 0:
                period.append(time.perf_counter() - start[0])
                bare_s.append(bare.run_round(rnd))
            if rnd == rounds:
                flat = np.concatenate([a.reshape(-1) for a in arrays.to_numpy_ndarrays()])
                diff.append(float(np.abs(flat - bare.final()).max()))
            start[:] = [time.perf_counter()]

        initial = ArrayRecord(bare.task.build_model().state_dict())
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                       evaluate_fn=evaluate_fn)

    run_config = {"scenario": "default", **WORKLOAD, "model.hidden": config["model"]["hidden"],
                  "federation.clients": n, "federation.rounds": rounds}
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)  # a few INFO lines per round; stderr stays readable
    try:
        run_simulation(server_app=server_app, client_app=flower_client_app(run_config),
                       num_supernodes=n,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    finally:
        flwr_logger.setLevel(level)
    if len(period) != rounds or not diff:
        raise RuntimeError(f"Flower's simulation ran {len(period)} of {rounds} rounds")
    return {"period": period, "bare": bare_s, "diff": diff[0]}


# --------------------------------------------------------------------------- cold start


def cold_child(engine: str, clients: int, hidden: list[int]) -> None:
    """In a fresh interpreter: run one round, print when it ended and the CPU time so far."""
    config = scenario(clients, hidden, rounds=1)
    if engine == "bare":
        BareLoop(config).run_round(1)
        ended, cpu = time.time(), time.process_time()
    else:
        from server.reporter import Reporter
        from simulations.cli import run_simulation

        marks: list[float] = []

        class EndOfRound(Reporter):
            def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
                marks.extend((time.time(), time.process_time()))

        with tempfile.TemporaryDirectory() as folder:
            run_simulation(config, engine="inprocess", reporter=EndOfRound(),
                           db=f"sqlite:///{os.path.join(folder, 'cold.db')}")
        ended, cpu = marks[0], marks[1]
    print(json.dumps({"round_end": ended, "cpu_s": cpu}))


def cold_start(clients: int, hidden: list[int], reps: int, threads: int) -> dict[str, Any]:
    """Median seconds from spawning a process to the end of its first round, per engine.

    Wall time is what the target is about; the child's CPU time up to that point is
    given too, as it suffers much less from a busy machine.
    """
    samples: dict[str, list[float]] = {"bare": [], "fedring": []}
    cpu: dict[str, list[float]] = {"bare": [], "fedring": []}
    for _ in range(reps):
        for engine in samples:
            cmd = [sys.executable, os.path.abspath(__file__), "--cold-child", engine,
                   "--threads", str(threads), "--cold-clients", str(clients),
                   "--cold-hidden", json.dumps(hidden)]
            t0 = time.time()
            out = subprocess.run(cmd, capture_output=True, text=True, env=START_ENV)
            if out.returncode != 0:
                raise RuntimeError(f"cold start of {engine} failed:\n{out.stderr[-3000:]}")
            child = json.loads(out.stdout.strip().splitlines()[-1])
            samples[engine].append(child["round_end"] - t0)
            cpu[engine].append(child["cpu_s"])
    bare, fed = median(samples["bare"]), median(samples["fedring"])
    bare_cpu, fed_cpu = median(cpu["bare"]), median(cpu["fedring"])
    return {"clients": clients, "hidden": hidden, "reps": reps, "bare_s": r4(bare),
            "fedring_s": r4(fed), "fedring_minus_bare_s": r4(fed - bare),
            "bare_cpu_s": r4(bare_cpu), "fedring_cpu_s": r4(fed_cpu),
            "fedring_minus_bare_cpu_s": r4(fed_cpu - bare_cpu),
            "samples": {k: [r4(v) for v in vs] for k, vs in samples.items()}}


# --------------------------------------------------------------------------- CIFAR-shape BN CNN

CIFAR_BN_FULL = {"clients": 100, "images_per_client": 16, "rounds": 3, "width": 32}
CIFAR_BN_QUICK = {"clients": 4, "images_per_client": 8, "rounds": 2, "width": 8}
CIFAR_BN_TEST_IMAGES = 64


def write_generated_cifar(folder: str, train_images: int, seed: int = 0) -> str:
    """Random uint8 images and labels written as CIFAR-10 python batches (five data batches
    and a test batch of pickled dicts, as the published files); returns the folder."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(seed)
    out = os.path.join(folder, f"cifar-10-batches-py-{time.time_ns()}")
    os.makedirs(out)
    sizes = [len(part) for part in np.array_split(np.arange(train_images), 5)]
    files = [(f"data_batch_{i + 1}", n) for i, n in enumerate(sizes)]
    for name, n in [*files, ("test_batch", CIFAR_BN_TEST_IMAGES)]:
        batch = {b"batch_label": name.encode(),
                 b"labels": rng.integers(0, 10, n).tolist(),
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"filenames": [f"{i}.png".encode() for i in range(n)]}
        with open(os.path.join(out, name), "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return out


def cifar_bn_scenario(path: str, clients: int, rounds: int, width: int) -> dict[str, Any]:
    """The cifar10 scenario on ``path``: IID, every client every round, plain SGD."""
    from simulations.config import load_scenario

    return load_scenario("cifar10", values={
        "data.options.path": path, "data.partitioner": "iid", "data.min_size": 1,
        "model.width": width, "federation.clients": clients, "federation.rounds": rounds,
        "federation.sample_fraction": 1.0, "federation.min_clients": clients,
        "train.local_epochs": 1, "train.batch_size": 16, "train.lr": 0.05,
        "train.momentum": 0.0, "train.weight_decay": 0.0})


def cifar_bn_case(quick: bool, reps: int, folder: str) -> dict[str, Any]:
    """(a) the bare loop beside (b) fedring on the batch-norm CNN at CIFAR shape."""
    from simulations.models import count_parameters
    from simulations.task import ScenarioTask

    size = CIFAR_BN_QUICK if quick else CIFAR_BN_FULL
    clients, rounds = size["clients"], size["rounds"]
    path = write_generated_cifar(folder, clients * size["images_per_client"])
    config = cifar_bn_scenario(path, clients, rounds, size["width"])
    task = ScenarioTask.from_config(config)
    dim = int(task.initial_params()[0].size)
    params = count_parameters(task.build_model())
    bare, net, period, evals = [], [], [], []
    diffs = []
    for _ in range(reps):
        run = run_fedring(config, folder)
        bare += run["bare"][1:]
        period += run["period"][1:]
        evals += run["eval"][1:]
        net += [p - e for p, e in zip(run["period"][1:], run["eval"][1:], strict=True)]
        diffs.append(run["diff"])
    a, b = median(bare), median(net)
    over = median([(x - y) / clients * 1e3 for x, y in zip(net, bare, strict=True)])
    row = {"clients": clients, "images_per_client": size["images_per_client"],
           "width": size["width"], "params": params, "float_buffers": dim - params,
           "vector": dim, "rounds": rounds, "warm_rounds": len(bare), "bare_s": r4(a),
           "fedring_s": r4(b), "fedring_raw_s": r4(median(period)),
           "fedring_eval_s": r4(median(evals)), "fedring_over_bare": r4(b / a),
           "fedring_over_bare_ms_per_client": r4(over),
           "fedring_vs_bare_max_abs_diff": float(f"{max(diffs):.3g}"),
           "bare_per_round_s": [r4(x) for x in bare],
           "fedring_per_round_s": [r4(x) for x in net]}
    log(f"CIFAR-shape BN CNN, N={clients} d={dim:,} ({params:,} parameters): bare "
        f"{a * 1e3:.1f} ms/round, fedring {b * 1e3:.1f} (eval {row['fedring_eval_s']} s "
        f"subtracted): {row['fedring_over_bare']}x, +{over:.2f} ms/client; model max |diff| "
        f"{row['fedring_vs_bare_max_abs_diff']}")
    return row


# --------------------------------------------------------------------------- driver


def bench(clients: int, hidden: list[int], rounds: int, flower_rounds: int, reps: int,
          with_flower: bool, folder: str) -> dict[str, Any]:
    """Rows of (a) beside (b), and (c) if asked, for one size. Flower runs between the
    fedring runs, so a drifting machine load weighs on both alike."""
    from simulations.task import ScenarioTask

    config = scenario(clients, hidden, rounds)
    dim = int(ScenarioTask.from_config(config).initial_params()[0].size)
    bare, period, wall, evals, writes, diffs = [], [], [], [], [], []
    fl: dict[str, Any] | None = None
    for i in range(reps):
        if with_flower and i == reps // 2:
            fl = run_flower(scenario(clients, hidden, flower_rounds))
        run = run_fedring(config, folder)
        bare += run["bare"][1:]
        period += run["period"][1:]
        wall += run["store_wall"][1:]
        evals += run["eval"][1:]
        writes += run["write"][1:]
        diffs.append(run["diff"])
    net = [p - e for p, e in zip(period, evals, strict=True)]
    a, b, raw = median(bare), median(net), median(period)
    over = median([(x - y) / clients * 1e3 for x, y in zip(net, bare, strict=True)])
    over_raw = median([(x - y) / clients * 1e3 for x, y in zip(period, bare, strict=True)])
    row: dict[str, Any] = {
        "clients": clients, "hidden": hidden, "params": dim, "rounds": rounds,
        "warm_rounds": len(bare), "bare_s": r4(a), "fedring_s": r4(b), "fedring_raw_s": r4(raw),
        "fedring_store_wall_s": r4(median(wall)), "fedring_eval_s": r4(median(evals)),
        "fedring_checkpoint_write_s": r4(median(writes)),
        "fedring_over_bare_ms_per_client": r4(over),
        "fedring_raw_over_bare_ms_per_client": r4(over_raw),
        "fedring_vs_bare_max_abs_diff": float(f"{max(diffs):.3g}"),
        "flower_s": None, "flower_rounds": None, "flower_bare_s": None,
        "flower_over_bare_ms_per_client": None, "flower_over_fedring": None,
        "flower_over_fedring_per_bare": None, "flower_vs_bare_max_abs_diff": None,
    }
    log(f"N={clients:>3} d={dim:>9,}: bare {a * 1e3:7.1f} ms/round, fedring {b * 1e3:7.1f} "
        f"(raw {raw * 1e3:.1f}, eval {row['fedring_eval_s'] * 1e3:.1f}, store wall_s "
        f"{row['fedring_store_wall_s'] * 1e3:.1f}, checkpoint write after it "
        f"{row['fedring_checkpoint_write_s'] * 1e3:.1f}): "
        f"+{row['fedring_over_bare_ms_per_client']} ms/client; model max |diff| "
        f"{row['fedring_vs_bare_max_abs_diff']}")
    if fl is not None:
        c, c_bare = median(fl["period"][1:]), median(fl["bare"][1:])
        c_over = median([(x - y) / clients * 1e3
                         for x, y in zip(fl["period"][1:], fl["bare"][1:], strict=True)])
        # Each engine's round in units of the bare round timed beside it: a load change
        # between the two engines' runs cancels out.
        per_bare = (c / c_bare) / (b / a)
        row.update(flower_s=r4(c), flower_rounds=flower_rounds, flower_bare_s=r4(c_bare),
                   flower_over_bare_ms_per_client=r4(c_over), flower_over_fedring=r4(c / b),
                   flower_over_fedring_per_bare=r4(per_bare),
                   flower_vs_bare_max_abs_diff=float(f"{fl['diff']:.3g}"),
                   flower_per_round_s=[r4(x) for x in fl["period"]],
                   flower_bare_per_round_s=[r4(x) for x in fl["bare"]])
        log(f"{'':>17}  flower {c * 1e3:7.1f} ms/round ({flower_rounds} rounds; bare beside it "
            f"{c_bare * 1e3:.1f}): +{row['flower_over_bare_ms_per_client']} ms/client, "
            f"{c / b:.1f}x fedring ({per_bare:.1f}x in bare rounds); model max |diff| "
            f"{row['flower_vs_bare_max_abs_diff']}")
    row.update(bare_per_round_s=[r4(x) for x in bare],
               fedring_per_round_s=[r4(x) for x in period],
               fedring_eval_per_round_s=[r4(x) for x in evals])
    return row


def targets(results: list[dict[str, Any]], cold: dict[str, Any] | None) -> dict[str, Any]:
    """Each target with whether it is met (None: not measured in this run)."""
    worst = max(r["fedring_over_bare_ms_per_client"] for r in results)
    big = [r for r in results if r["clients"] == 100 and r["params"] > 1_000_000
           and r["flower_over_fedring"] is not None]
    ratio = big[0]["flower_over_fedring"] if big else None
    per_bare = big[0]["flower_over_fedring_per_bare"] if big else None
    extra = cold["fedring_minus_bare_s"] if cold else None
    return {
        "fedring_within_2ms_per_client_of_bare": {
            "met": worst <= TARGET_PER_CLIENT_MS, "worst_ms_per_client": worst},
        "fedring_3x_faster_than_flower_at_n100_1m": {
            "met": None if ratio is None else ratio >= TARGET_FLOWER_RATIO,
            "flower_over_fedring": ratio, "flower_over_fedring_per_bare": per_bare},
        "cold_start_within_0_5s_of_bare": {
            "met": None if extra is None else extra <= TARGET_COLD_S,
            "fedring_minus_bare_s": extra,
            "fedring_minus_bare_cpu_s": cold["fedring_minus_bare_cpu_s"] if cold else None},
    }


def parse_sizes(text: str) -> list[tuple[int, list[int]]]:
    """``10x10k,100x1m`` -> [(10, SMALL), (100, LARGE)]."""
    sizes = []
    for item in text.split(","):
        clients, _, params = item.strip().partition("x")
        if not clients.isdigit() or params not in HIDDEN:
            raise argparse.ArgumentTypeError(f"bad size '{item}': write e.g. 10x10k or 100x1m")
        sizes.append((int(clients), HIDDEN[params]))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="N=4, 10k parameters, 2 rounds, bare and fedring only")
    parser.add_argument("--reps", type=int, default=None,
                        help="fedring runs per size (default 2, quick 1)")
    parser.add_argument("--no-flower", action="store_true", help="skip Flower's Ray engine")
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help="clients x parameters to run, e.g. 10x10k,100x1m (default: all "
                             "four of 10 and 100 clients at 10k and 1m)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-start timing")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads here and in the cold starts (Ray actors get 1 "
                             "each); 1 keeps a shared machine's noise down")
    parser.add_argument("--cifar-bn", action="store_true",
                        help="also the batch-norm CNN at CIFAR shape, 100 clients (quick: 4)")
    parser.add_argument("--cifar-bn-only", action="store_true",
                        help="only the batch-norm CNN at CIFAR shape")
    parser.add_argument("--pfl-python", default=None,
                        help="interpreter with pfl[pytorch]==0.6.0 (its own venv) to run pfl "
                             "on its workload; without it pfl is skipped")
    parser.add_argument("--fedring-baseline", default=None, metavar="TREE",
                        help="a checkout of an earlier fedring: its in-process engine runs "
                             "on the pfl workload too (before/after in one run)")
    parser.add_argument("--pfl-reps", type=int, default=None,
                        help="alternations of the pfl workload's systems (default 7, quick 1)")
    parser.add_argument("--pfl-sizes", default=None,
                        help="sizes of the pfl workload, e.g. 10k,1m (default both; quick 10k)")
    parser.add_argument("--pfl-workload-only", action="store_true",
                        help="only the pfl workload (no fedring-sizes table, no cold start)")
    parser.add_argument("--memory-users", default=None,
                        help="client counts whose FedProx Synthetic load's peak memory is "
                             "recorded, e.g. 1000,3000,10000 (the default; quick: 300; 0: skip)")
    parser.add_argument("--no-pfl-workload", action="store_true",
                        help="skip the pfl workload")
    parser.add_argument("--cohort-sizes", default=None,
                        help="only the cohort-size mode: every client of N every round at "
                             "10k parameters, e.g. 100,10000 (quick: 20,200)")
    parser.add_argument("--cohort-rounds", type=int, default=3,
                        help="rounds of the cohort-size mode (the first is a warm-up)")
    parser.add_argument("--cold-child", choices=("bare", "fedring"), help=argparse.SUPPRESS)
    parser.add_argument("--cold-clients", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--cold-hidden", default="[128]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.cold_child:
        cold_child(args.cold_child, args.cold_clients, json.loads(args.cold_hidden))
        return

    started = time.perf_counter()
    load_before = load_average()
    quick = args.quick
    if args.cohort_sizes is not None:
        with tempfile.TemporaryDirectory() as folder:
            cohorts = cohort_overhead([int(n) for n in args.cohort_sizes.split(",")],
                                      2 if quick else args.cohort_rounds, folder)
        print(json.dumps({"benchmark": "simulation_overhead", "mode": "cohort_sizes",
                          "quick": quick, "machine": machine(), "loadavg_before": load_before,
                          "loadavg_after": load_average(), "cohorts": cohorts,
                          "wall_s": round(time.perf_counter() - started, 1)}), flush=True)
        return
    sizes = args.sizes or (QUICK_SIZES if quick else FULL_SIZES)
    rounds = 2 if quick else 5
    reps = args.reps or (1 if quick else 2)
    with_flower = not (quick or args.no_flower)
    log(f"simulation_overhead: {'quick' if quick else 'full'}, {rounds} rounds (first is "
        f"warm-up), {reps} fedring run(s) per size; load average {load_before[0]:.2f}")
    pfl_rows = []
    if not (args.no_pfl_workload or args.cifar_bn_only):
        if args.pfl_python is None:
            log("pfl workload: pfl skipped (give --pfl-python, an interpreter with "
                "pfl[pytorch]==0.6.0)")
        pfl_reps = args.pfl_reps or (1 if quick else 7)
        pfl_sizes = (args.pfl_sizes.split(",") if args.pfl_sizes
                     else ["10k"] if quick else ["10k", "1m"])
        for size in pfl_sizes:
            pfl_rows.append(pfl_compare(size, clients=10 if quick else 100,
                                        rounds=3 if quick else 8, reps=pfl_reps,
                                        pfl_python=args.pfl_python, threads=args.threads,
                                        vectorized=True, baseline=args.fedring_baseline))
    memory_users = [int(u) for u in (args.memory_users or ("300" if quick else
                                                            "1000,3000,10000")).split(",")]
    memory = population_memory([u for u in memory_users if u > 0
                                and not args.cifar_bn_only])
    if args.pfl_workload_only or args.cifar_bn_only:
        sizes, args.no_cold = [], True
    results = []
    cifar_bn = None
    with tempfile.TemporaryDirectory() as folder:
        if args.cifar_bn or args.cifar_bn_only:
            cifar_bn = cifar_bn_case(quick, reps=1, folder=folder)
        for clients, hidden in sizes:
            # Ray at N=100 with 1M parameters is the slow part: one warm round fewer there.
            f_rounds = rounds - 1 if clients >= 100 and hidden == LARGE else rounds
            results.append(bench(clients, hidden, rounds, f_rounds, reps, with_flower, folder))
    cold_clients = 4 if quick else 10
    cold = None
    if not args.no_cold:
        cold = cold_start(cold_clients, SMALL, reps=1 if quick else 3, threads=args.threads)
        log(f"cold start (N={cold_clients}, 10k params): bare {cold['bare_s']} s, fedring "
            f"{cold['fedring_s']} s ({cold['fedring_minus_bare_s']:+} s); CPU "
            f"{cold['bare_cpu_s']} s and {cold['fedring_cpu_s']} s "
            f"({cold['fedring_minus_bare_cpu_s']:+} s)")
    summary = {
        "benchmark": "simulation_overhead",
        "quick": quick,
        "workload": {"dataset": "digits", "model": "mlp", **WORKLOAD,
                     "all_clients_every_round": True, "fedring_runs_per_size": reps,
                     "fedring": "round period minus central evaluation (raw also given)",
                     "flower": "Ray, 1 CPU per actor, flwr FedAvg, no evaluation",
                     "overheads": "medians over warm rounds of (engine - bare beside it) / N"},
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "results": results,
        "cold_start": cold,
        "cifar_bn": cifar_bn,
        "population_memory": memory,
        "pfl_workload": {"pfl": args.pfl_python is not None, "rows": pfl_rows,
                         "targets": pfl_targets(pfl_rows)},
        "targets": targets(results, cold) if results else {},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    for name, t in {**summary["targets"], **summary["pfl_workload"]["targets"]}.items():
        cpu = f" (in CPU time: {t['met_in_cpu_time']})" if "met_in_cpu_time" in t else ""
        log(f"target {name}: {'not measured' if t['met'] is None else t['met']}{cpu}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
