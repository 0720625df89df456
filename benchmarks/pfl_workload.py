"""pfl-research's benchmark workload: a pfl-style bare loop, fedring and pfl, alternated.

The workload (pfl 0.6's own benchmark): digits split IID into 100 clients, an MLP
64-128-10 (9,610 parameters) or 64-960-960-10 (994,570), one local epoch of SGD
(lr 0.05, batch 32, no momentum), every client every round, central evaluation on the
test set after every round. Each system's figure is the median wall time of its warm
rounds (the first round of a run is dropped), evaluation included:

- bare: a sequential torch loop written the way pfl's benchmark writes it: one model and
  one optimizer reused for every client, each client's tensors built before the first
  round, the weighted delta accumulated in place into one running sum; then the FedAvg
  step and the central evaluation. Same seeds and batches as fedring, so both must end
  with the same model (the largest difference is reported as a check).
- bare_unwrapped_step: the same loop stepping its optimizer through
  ``client.optim_step``, as fedring's local training does (torch's SGD step without
  ``Optimizer.step``'s per-call wrapper, bit for bit the same model): how much of
  fedring's lead comes from that step alone. ``fedring_to_bare_unwrapped_step`` is
  fedring's ratio to it.
- fedring: ``run_simulation`` on the in-process engine with the scenario's defaults
  (SQLite store, a checkpoint every round), timed from one ``round_finished`` to the next;
  ``fedring_vectorized`` is the same with ``[engine] vectorize = true``, and
  ``fedring_auto`` with ``vectorize = "auto"`` (at 1M parameters: one client at a time).
  Each fedring run is interleaved with a bare loop of its own, round by round: after each
  of fedring's rounds (its clock stopped) one round of the bare loop runs, and fedring's
  checkpoint of that round is handed to the store's writer thread only when fedring's
  next round starts, so it overlaps fedring's round as in a run of its own, never the
  bare round. Each warm round's ratio to the bare round beside it is one pair; a
  repetition's figure is the median of its pairs (``paired_rounds``: all pairs pooled).
- fedring_baseline (given ``--fedring-baseline PATH``, a checkout of an earlier fedring,
  e.g. ``git worktree add /tmp/before <commit>``): the same interleaved fedring run, in a
  child process importing that checkout: the before/after of a change in one run.
- bare_unwrapped_step and pfl (``benchmarks/pfl_runner.py`` in the interpreter given,
  pfl's own venv, on the same partitions, test set and initial weights) run whole, each
  as a ratio of its median warm round to the median of the bare rounds interleaved with
  fedring in the same repetition.

The systems run one after the other, ``reps`` times. Each round is timed twice: wall
time (the workload's measure) and the process's CPU time (all its threads: fedring's
store writer included), which a machine shared with other work disturbs far less; every
process runs torch on one thread.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from harness import WHOLE_PARTITIONS, log

RUNNER = Path(__file__).resolve().parent / "pfl_runner.py"
PFL_SIZES = {"10k": [128], "1m": [960, 960]}  # 9,610 and 994,570 parameters on digits
WORKLOAD = {**WHOLE_PARTITIONS,
            "data.partitioner": "iid", "train.local_epochs": 1, "train.batch_size": 32,
            "train.lr": 0.05, "train.optimizer": "sgd", "train.momentum": 0.0}
TARGET_RATIO = {"10k": 1.5, "1m": 1.15}  # fedring / bare, at most
TARGET_VECTORIZED_10K = 1.0  # fedring vectorized / bare at 10k parameters, below
AUTO_TOLERANCE = 1.05  # "auto" against the faster of sequential and vectorized, at most


def scenario(clients: int, hidden: list[int], rounds: int,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from simulations.config import load_scenario

    return load_scenario("default", values={**WORKLOAD, "model.hidden": list(hidden),
                                            "federation.clients": clients,
                                            "federation.rounds": rounds, **(extra or {})})


Rounds = tuple[list[float], list[float]]  # wall and CPU seconds of each round


def paired_ratios(system_s: list[float], bare_s: list[float]) -> list[float]:
    """Each warm round's ratio to the bare round timed right after it."""
    return [f / b for f, b in zip(system_s[1:], bare_s[1:], strict=True)]


def spread_of(xs: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of ``xs``, to 3 figures."""
    q1, med, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return {k: float(f"{v:.3g}") for k, v in
            {"n": len(xs), "median": med, "q1": q1, "q3": q3, "min": min(xs),
             "max": max(xs)}.items()}


def warm_median(round_s: list[float]) -> float:
    warm = round_s[1:] or round_s
    return statistics.median(warm) if warm else math.nan


class Clock:
    """Wall and CPU time between successive marks."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def mark(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now

    def restart(self) -> None:
        """Start the next interval now (the time since the last mark is not counted)."""
        self._last = None
        self.mark()

    def rounds(self) -> Rounds:
        return self.wall, self.cpu


class PflStyleBare:
    """The bare loop as pfl's benchmark writes it (see the module docstring)."""

    def __init__(self, config: dict[str, Any], *, unwrapped_step: bool = False) -> None:
        import torch

        from client.app import training_seed
        from client.flat_model import FlatModel
        from simulations.task import ScenarioTask

        self._torch, self._seed_of = torch, training_seed
        self.task = ScenarioTask.from_config(config)
        self.model = FlatModel(self.task.build_model())
        self.flat = self.model.flat
        self.global_w = self.flat.clone()
        self.acc = torch.empty_like(self.flat)
        cfg = self.task.train_config
        self.opt = torch.optim.SGD(self.model.module.parameters(), lr=cfg.lr)
        self.unwrapped_step = unwrapped_step
        self.data = [self.task.partition(pid) for pid in range(self.task.clients)]
        ds = self.task.dataset
        self.test = (torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test))

    def run(self, rounds: int) -> Rounds:
        """Wall and CPU seconds of each round, central evaluation included."""
        clock = Clock()
        clock.mark()
        for rnd in range(1, rounds + 1):
            self.round(rnd)
            clock.mark()
        return clock.rounds()

    def round(self, rnd: int) -> None:
        """Round ``rnd``: every client's training, the FedAvg step and the evaluation."""
        from torch.nn import functional as F

        from client import optim_step
        from client.training import evaluate

        torch, module, opt = self._torch, self.model.module, self.opt
        unwrapped = self.unwrapped_step
        batch = self.task.train_config.batch_size
        self.acc.zero_()
        total = 0
        module.train()
        for pid, (x, y) in enumerate(self.data):
            self.flat.copy_(self.global_w)
            gen = torch.Generator().manual_seed(self._seed_of(self.task.seed, rnd, pid))
            order = torch.randperm(len(x), generator=gen)
            for start in range(0, len(x), batch):
                idx = order[start:start + batch]
                if unwrapped:
                    optim_step.zero_grad(opt)
                else:
                    opt.zero_grad(set_to_none=True)
                F.cross_entropy(module(x[idx]), y[idx]).backward()
                if unwrapped:
                    optim_step.step(opt)
                else:
                    opt.step()
            with torch.no_grad():
                self.flat.sub_(self.global_w)  # the delta, in place
                self.acc.add_(self.flat, alpha=float(len(x)))
            total += len(x)
        with torch.no_grad():
            self.global_w.add_(self.acc, alpha=1.0 / total)
            self.flat.copy_(self.global_w)
        evaluate(module, *self.test)


@contextmanager
def deferred_checkpoints() -> Iterator[list[Callable[[], None]]]:
    """Hold the store's background checkpoint writes until the caller releases them.

    A round's checkpoint is handed to the writer thread just before the round is reported;
    interleaved with the bare loop, it would run during the bare round. Held, then released
    when fedring's next round starts, it overlaps that round, as in a run of its own."""
    try:
        from server.store.checkpoints import BackgroundWriter
    except ImportError:  # an earlier checkout without the writer thread
        yield []
        return
    held: list[Callable[[], None]] = []
    submit = BackgroundWriter.submit

    def hold(self: Any, *args: Any, **kwargs: Any) -> None:
        held.append(partial(submit, self, *args, **kwargs))

    BackgroundWriter.submit = hold  # type: ignore[method-assign]
    try:
        yield held
    finally:
        BackgroundWriter.submit = submit  # type: ignore[method-assign]


def run_fedring(config: dict[str, Any], folder: str,
                bare: PflStyleBare | None = None) -> tuple[Rounds, Any, Rounds | None]:
    """Round times of ``run_simulation`` (in-process) and the final model; given ``bare``,
    one round of the bare loop after each of fedring's, timed apart (and its round times),
    fedring's clock stopped meanwhile and its checkpoint writes held until it resumes."""
    from server.reporter import Reporter
    from simulations.cli import run_simulation
    from simulations.task import ScenarioTask

    clock, bare_clock = Clock(), Clock()

    class Marks(Reporter):
        def run_started(self, run_id: str, config: dict[str, Any]) -> None:
            clock.mark()  # after the round-0 evaluation

        def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
            clock.mark()
            if bare is None:
                return
            bare_clock.restart()
            bare.round(rnd)
            bare_clock.mark()
            clock.restart()  # fedring's next round starts with its held checkpoint
            while held:
                held.pop(0)()

    last: list[Any] = []
    evaluate = ScenarioTask.evaluate

    def keep_last(task: ScenarioTask, params: Any) -> dict[str, float]:
        last[:] = [params]  # the server's model, updated in place: ends as the final one
        return evaluate(task, params)

    rep = Marks()
    url = f"sqlite:///{os.path.join(folder, f'pfl-{time.time_ns()}.db')}"
    ScenarioTask.evaluate = keep_last  # type: ignore[method-assign]
    try:
        with deferred_checkpoints() if bare is not None else nullcontext([]) as held:
            run_simulation(config, engine="inprocess", db=url, reporter=rep)
    finally:
        ScenarioTask.evaluate = evaluate  # type: ignore[method-assign]
    return clock.rounds(), last[0], bare_clock.rounds() if bare is not None else None


def run_fedring_baseline(args: dict[str, Any], tree: str,
                         folder: str) -> tuple[Rounds, Rounds]:
    """``run_fedring`` interleaved with the bare loop in a child process that imports
    fedring from ``tree``, on ``scenario(**args)`` as that checkout resolves it (its
    config keys may differ): fedring's round times and the bare loop's."""
    path = os.path.join(folder, "scenario.json")
    with open(path, "w") as f:
        json.dump(args, f)
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, __file__, "--fedring-child", path, folder],
                         capture_output=True, text=True, env=env, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"the baseline fedring failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return (got["round_s"], got["round_cpu_s"]), (got["bare_s"], got["bare_cpu_s"])


def write_workload(config: dict[str, Any], path: str) -> None:
    """Every client's partition, the test set and the initial weights, for pfl's runner."""
    import numpy as np

    from simulations.task import ScenarioTask

    task = ScenarioTask.from_config(config)
    ds = task.dataset
    arrays: dict[str, Any] = {"clients": np.array(task.clients),
                              "num_classes": np.array(ds.num_classes),
                              "x_test": ds.x_test, "y_test": ds.y_test,
                              "w0": task.initial_params()[0]}
    for pid in range(task.clients):
        x, y = task.partition(pid)
        arrays[f"x{pid}"], arrays[f"y{pid}"] = x.numpy(), y.numpy()
    np.savez(path, **arrays)


def run_pfl(python: str, workload: str, hidden: list[int], rounds: int,
            threads: int) -> Rounds:
    cmd = [python, str(RUNNER), workload, "--rounds", str(rounds), "--hidden",
           *map(str, hidden), "--lr", str(WORKLOAD["train.lr"]),
           "--batch", str(WORKLOAD["train.batch_size"]), "--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # pfl's venv only
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"pfl's runner failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["round_s"], got["round_cpu_s"]


def compare(size: str, *, clients: int, rounds: int, reps: int, pfl_python: str | None,
            threads: int, vectorized: bool, baseline: str | None = None) -> dict[str, Any]:
    """One size: each system's median warm round per repetition and its ratio to bare."""
    import numpy as np

    hidden = PFL_SIZES[size]
    config = scenario(clients, hidden, rounds)
    vec_config = scenario(clients, hidden, rounds, {"engine.vectorize": True}) if vectorized \
        else None
    auto_config = scenario(clients, hidden, rounds, {"engine.vectorize": "auto"}) \
        if vectorized else None
    per_rep: list[dict[str, float]] = []
    # every warm round's ratio to the bare round beside it, over all repetitions
    paired: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"wall": [], "cpu": []})
    diffs: list[float] = []
    step_diffs: list[float] = []  # the unwrapped step's model against the bare loop's: 0
    with tempfile.TemporaryDirectory() as folder:
        workload = os.path.join(folder, "workload.npz")
        if pfl_python:
            write_workload(config, workload)
        for _ in range(reps):
            row: dict[str, float] = {}

            def put(system: str, rounds_: Rounds, row: dict[str, float] = row) -> None:
                row[f"{system}_s"] = warm_median(rounds_[0])
                row[f"{system}_cpu_s"] = warm_median(rounds_[1])

            def put_paired(system: str, rounds_: Rounds, bare_rounds: Rounds,
                           row: dict[str, float] = row) -> None:
                put(system, rounds_)
                for i, clock in enumerate(("wall", "cpu")):
                    pairs = paired_ratios(rounds_[i], bare_rounds[i])
                    row[f"{system}_{clock}_ratio"] = statistics.median(pairs)
                    paired[system][clock].extend(pairs)

            bare = PflStyleBare(config)
            times, final, bare_rounds = run_fedring(config, folder, bare)
            assert bare_rounds is not None
            put("bare", bare_rounds)
            put_paired("fedring", times, bare_rounds)
            diffs.append(float(np.abs(final - bare.global_w.numpy()).max()))
            unwrapped = PflStyleBare(config, unwrapped_step=True)
            put("bare_unwrapped_step", unwrapped.run(rounds))
            step_diffs.append(float(np.abs(unwrapped.global_w.numpy()
                                           - bare.global_w.numpy()).max()))
            if baseline:
                times, bare_rounds = run_fedring_baseline(
                    {"clients": clients, "hidden": hidden, "rounds": rounds}, baseline, folder)
                put_paired("fedring_baseline", times, bare_rounds)
            for name, other in (("fedring_vectorized", vec_config),
                                ("fedring_auto", auto_config)):
                if other is not None:
                    beside = PflStyleBare(other)
                    times, final, bare_rounds = run_fedring(other, folder, beside)
                    assert bare_rounds is not None
                    put_paired(name, times, bare_rounds)
                    diffs.append(float(np.abs(final - beside.global_w.numpy()).max()))
            if pfl_python:
                put("pfl", run_pfl(pfl_python, workload, hidden, rounds, threads))
            per_rep.append(row)
    dim = int(bare.flat.numel())
    systems = [k[:-2] for k in per_rep[0] if k.endswith("_s") and not k.endswith("cpu_s")
               and k != "bare_s"]

    def ratio(r: dict[str, float], system: str, clock: str) -> float:
        """Interleaved systems: the median of their rounds' ratios to the bare round run
        right after each; the others: their median round over the bare loop's."""
        if f"{system}_{clock}_ratio" in r:
            return r[f"{system}_{clock}_ratio"]
        cpu = "_cpu" if clock == "cpu" else ""
        return r[f"{system}{cpu}_s"] / r[f"bare{cpu}_s"]

    ratios = {s: [ratio(r, s, "wall") for r in per_rep] for s in systems}
    cpu_ratios = {s: [ratio(r, s, "cpu") for r in per_rep] for s in systems}

    def summary(xs: dict[str, list[float]]) -> dict[str, Any]:
        return {"per_rep": {s: [float(f"{x:.3g}") for x in v] for s, v in xs.items()},
                "median": {s: float(f"{statistics.median(v):.3g}") for s, v in xs.items()}}

    result: dict[str, Any] = {
        "size": size, "clients": clients, "hidden": hidden, "params": dim, "rounds": rounds,
        "reps": reps, "per_rep_s": [{k: float(f"{v:.4g}") for k, v in r.items()} for r in per_rep],
        "wall_ratio_to_bare": summary(ratios), "cpu_ratio_to_bare": summary(cpu_ratios),
        "fedring_vs_bare_max_abs_diff": float(f"{max(diffs):.3g}"),
        "bare_unwrapped_step_vs_bare_max_abs_diff": max(step_diffs),
        "paired_rounds": {s: {clock: spread_of(v) for clock, v in p.items()}
                          for s, p in paired.items()},
        "fedring_to_bare_unwrapped_step": summary(
            {"fedring": [r["fedring_s"] / r["bare_unwrapped_step_s"] for r in per_rep]}),
    }

    def shown(xs: dict[str, list[float]]) -> str:
        return ", ".join(f"{s} {min(v):.2f}-{max(v):.2f}x" for s, v in xs.items())

    log(f"pfl workload N={clients} d={dim:,}: bare "
        f"{statistics.median(r['bare_s'] for r in per_rep) * 1e3:.1f} ms/round (CPU "
        f"{statistics.median(r['bare_cpu_s'] for r in per_rep) * 1e3:.1f}); wall: "
        f"{shown(ratios)}; CPU: {shown(cpu_ratios)}; fedring vs bare max |diff| "
        f"{result['fedring_vs_bare_max_abs_diff']}; fedring over bare_unwrapped_step "
        f"{shown(result['fedring_to_bare_unwrapped_step']['per_rep'])}")
    return result


def pfl_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """fedring's ratio targets, by the median over repetitions of the wall-time ratio and
    of the CPU-time ratio (None: size not run)."""
    out: dict[str, Any] = {}
    wall = {r["size"]: r["wall_ratio_to_bare"]["median"] for r in rows}
    cpu = {r["size"]: r["cpu_ratio_to_bare"]["median"] for r in rows}

    def target(name: str, size: str, system: str, ok: Any) -> None:
        w, c = wall.get(size, {}).get(system), cpu.get(size, {}).get(system)
        out[name] = {"met": None if w is None else bool(ok(w)),
                     "met_in_cpu_time": None if c is None else bool(ok(c)),
                     "wall_ratio": w, "cpu_ratio": c}

    for size, bound in TARGET_RATIO.items():
        target(f"fedring_at_most_{bound}x_bare_at_{size}", size, "fedring",
               lambda r, b=bound: r <= b)
    target("fedring_vectorized_below_bare_at_10k", "10k", "fedring_vectorized",
           lambda r: r < TARGET_VECTORIZED_10K)
    for size in TARGET_RATIO:  # "auto" never slower than sequential (5% for noise)
        w = wall.get(size, {})
        c = cpu.get(size, {})
        if "fedring_auto" in w:
            out[f"fedring_auto_not_slower_than_sequential_at_{size}"] = {
                "met": w["fedring_auto"] <= AUTO_TOLERANCE * min(w["fedring"], w.get(
                    "fedring_vectorized", math.inf)),
                "met_in_cpu_time": c["fedring_auto"] <= AUTO_TOLERANCE * min(
                    c["fedring"], c.get("fedring_vectorized", math.inf)),
                "wall_ratio": w["fedring_auto"], "cpu_ratio": c["fedring_auto"]}
    return out


def fedring_child(args_path: str, folder: str) -> None:
    """In a child process: ``run_fedring`` interleaved with the bare loop on
    ``scenario(**args)``; print both round times."""
    import torch

    torch.set_num_threads(1)
    with open(args_path) as f:
        config = scenario(**json.load(f))
    (wall, cpu), _, bare = run_fedring(config, folder, PflStyleBare(config))
    assert bare is not None
    print(json.dumps({"round_s": wall, "round_cpu_s": cpu, "bare_s": bare[0],
                      "bare_cpu_s": bare[1]}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--fedring-child":
        fedring_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit("run benchmarks/simulation_overhead.py --pfl-workload-only")
