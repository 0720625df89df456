"""Crossbow's learners inside a silo: L small-batch learners with SMA against one learner.

Workload: the default scenario's task trained centrally in one silo process (digits, all
of its training split, the MLP with one hidden layer of 64, SGD at the scenario's lr 0.05
with momentum 0.9), one torch thread. Systems, measured side by side, alternated:

- ``sma_L{L}_b{B}``: ``L`` learners of batch ``B`` (``client.silo.learners``, one
  batched computation, ``silo.sma_momentum`` / ``silo.sma_correction`` at their defaults);
- ``one_b{B*L}``: one learner at batch ``B * L`` (the same samples per step);
- ``one_b{B}``: one learner at batch ``B`` (the same batch per learner).

Figures: samples per second (one epoch's examples over its training seconds, the median
of ``--repeats`` epochs) for B = 8, L = 4; and, for B = 16, L = 4, the training seconds
and epochs to reach ``--target`` accuracy on the test split (the default scenario sets no
``driver.target_accuracy``; 0.95 is used), evaluating the average model after every
epoch (each epoch is one silo round: the learners restart from the average model).
Ratios matter, not seconds: they are measured on a shared 2-core VM. A plot goes to
docs/crossbow.png.

    python benchmarks/crossbow.py [--quick] [--target A] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.protocol.learners import LearnerSpec  # noqa: E402
from client.silo.learners import train_learners  # noqa: E402
from client.training import TrainConfig, evaluate, train  # noqa: E402
from server.cross_silo_config import SiloConfig  # noqa: E402
from simulations.config import load_scenario  # noqa: E402
from simulations.task import ScenarioTask  # noqa: E402


def workload() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The default scenario's task, all of its training split and its test split."""
    config = load_scenario("default", values={"federation.clients": 1, "federation.min_clients": 1,
                                              "data.partitioner": "iid"})
    task = ScenarioTask.from_config(config)
    ds = task.dataset
    return (task, torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train).long(),
            torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test).long(), config["train"])


def one_epoch(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, train_cfg: dict,
              batch: int, learners: int, seed: int) -> float:
    """Train one epoch in place; its seconds."""
    cfg = TrainConfig(local_epochs=1, batch_size=batch, lr=train_cfg["lr"],
                      optimizer="sgd", momentum=train_cfg["momentum"])
    silo = SiloConfig()
    t0 = time.perf_counter()
    if learners > 1:
        spec = LearnerSpec(learners, momentum=silo.sma_momentum, correction=silo.sma_correction)
        train_learners(module, x, y, cfg, spec, seed=seed)
    else:
        train(module, x, y, cfg, seed=seed)
    return time.perf_counter() - t0


def systems(b: int, learners: int) -> dict[str, tuple[int, int]]:
    """name -> (batch, learners)."""
    return {f"sma_L{learners}_b{b}": (b, learners), f"one_b{b * learners}": (b * learners, 1),
            f"one_b{b}": (b, 1)}


def throughput(task: Any, x: torch.Tensor, y: torch.Tensor, train_cfg: dict, b: int,
               learners: int, repeats: int) -> dict[str, float]:
    """Samples per second of each system: the median of ``repeats`` alternated epochs."""
    seconds: dict[str, list[float]] = {name: [] for name in systems(b, learners)}
    modules = {name: task.build_model() for name in seconds}
    for r in range(repeats + 1):  # the first pass warms up
        for name, (batch, count) in systems(b, learners).items():
            s = one_epoch(modules[name], x, y, train_cfg, batch, count, seed=r)
            if r:
                seconds[name].append(s)
    return {name: len(x) / statistics.median(s) for name, s in seconds.items()}


def to_target(task: Any, x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor,
              yt: torch.Tensor, train_cfg: dict, b: int, learners: int, target: float,
              max_epochs: int) -> dict[str, dict[str, Any]]:
    """Each system's accuracy curve, and its training seconds and epochs to ``target``;
    the systems take their epochs in turn."""
    runs = {name: {"module": task.build_model(), "seconds": 0.0, "curve": [],
                   "reached": None} for name in systems(b, learners)}
    for epoch in range(1, max_epochs + 1):
        for name, (batch, count) in systems(b, learners).items():
            run = runs[name]
            if run["reached"] is not None:
                continue
            run["seconds"] += one_epoch(run["module"], x, y, train_cfg, batch, count,
                                        seed=epoch)
            _, acc = evaluate(run["module"], xt, yt)
            run["curve"].append([round(run["seconds"], 4), acc])
            if acc >= target:
                run["reached"] = {"epochs": epoch, "seconds": run["seconds"]}
    return {name: {k: v for k, v in run.items() if k != "module"} for name, run in runs.items()}


def plot(path: Path, rates: dict[str, float], curves: dict[str, dict], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(list(rates), list(rates.values()), color=["tab:red", "tab:blue", "tab:gray"])
    left.set_ylabel("samples / s (one thread)")
    left.set_title("throughput")
    for name, run in curves.items():
        xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
        right.plot(xs, ys, marker="o", label=name)
    right.axhline(target, color="k", linestyle=":", label=f"target {target}")
    right.set_xlabel("training seconds")
    right.set_ylabel("test accuracy")
    right.set_title("time to accuracy")
    right.legend()
    fig.suptitle("Crossbow's SMA learners in a silo (ratios; shared 2-core VM)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few epochs, no plot")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "crossbow.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task, x, y, xt, yt, train_cfg = workload()
    repeats, max_epochs = (1, 2) if args.quick else (args.repeats, args.max_epochs)
    rates = throughput(task, x, y, train_cfg, 8, 4, repeats)
    curves = to_target(task, x, y, xt, yt, train_cfg, 16, 4, args.target, max_epochs)
    silo = SiloConfig()
    reached = {name: run["reached"] for name, run in curves.items()}
    sma, big = reached["sma_L4_b16"], reached["one_b64"]
    result = {
        "benchmark": "crossbow", "quick": args.quick, "examples": len(x),
        "sma_momentum": silo.sma_momentum, "sma_correction": silo.sma_correction,
        "lr": train_cfg["lr"], "momentum": train_cfg["momentum"], "target": args.target,
        "samples_per_s": rates,
        "throughput_ratio_L4_b8_over_one_b8": rates["sma_L4_b8"] / rates["one_b8"],
        "to_target": curves,
        "time_ratio_L4_b16_over_one_b64": (sma["seconds"] / big["seconds"]
                                           if sma and big else None),
    }
    if not args.quick:
        plot(args.plot, rates, curves, args.target)
        result["plot"] = str(args.plot.relative_to(ROOT)) if args.plot.is_relative_to(ROOT) \
            else str(args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
