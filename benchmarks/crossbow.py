"""Crossbow's learners inside a silo: L small-batch learners with SMA against one learner.

Workload: the default scenario's task trained centrally in one silo process (digits, all
of its training split, the MLP with one hidden layer of 64, SGD at the scenario's lr 0.05
with momentum 0.9), one torch thread. Systems, measured side by side, alternated:

- ``sma_L{L}_b{B}``: ``L`` learners of batch ``B`` (``client.silo.learners``, one
  batched computation, ``silo.sma_momentum`` / ``silo.sma_correction`` at their defaults
  unless ``--sma-*`` says otherwise), persisting across epochs (``LearnerState``);
- ``one_b{B*L}``: one learner at batch ``B * L`` (the same samples per step), as a silo
  with one learner trains a round (``client.training.train``: a fresh optimizer);
- ``one_b{B}``: one learner at batch ``B`` (the same batch per learner);
- ``one_b{B*L}_kept`` (time to target only): one learner at batch ``B * L`` whose SGD
  momentum carries across epochs, as the learners' does.

Figures: samples per second (one epoch's examples over its training seconds, the median
of ``--repeats`` epochs, first seed) for B = 8, L = 4; and, for B = 16, L = 4, per run
seed (``--seeds``: the scenario's split and initial model), the training seconds and
epochs to reach ``--target`` accuracy on the test split (the default scenario sets no
``driver.target_accuracy``; 0.95 is used), evaluating the average model after every
epoch (each epoch is one silo round), and the median and worst time ratio over the
seeds. Ratios matter, not seconds: they are measured on a shared 2-core VM. A plot
goes to docs/crossbow.png.

    python benchmarks/crossbow.py [--quick] [--seeds 0-7] [--target A] [--lr LR]
        [--sma-correction A] [--sma-momentum M] [--no-throughput] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.protocol.learners import LearnerSpec  # noqa: E402
from client.silo.learners import LearnerState, train_learners  # noqa: E402
from client.training import TrainConfig, evaluate, make_optimizer, train  # noqa: E402
from server.cross_silo_config import SiloConfig  # noqa: E402
from simulations.config import load_scenario  # noqa: E402
from simulations.task import ScenarioTask  # noqa: E402


def workload(seed: int = 0) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, dict]:
    """The default scenario's task at run seed ``seed`` (its split and initial model), all
    of its training split and its test split."""
    config = load_scenario("default", values={"federation.clients": 1, "federation.min_clients": 1,
                                              "data.partitioner": "iid", "seed": seed})
    task = ScenarioTask.from_config(config)
    ds = task.dataset
    return (task, torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train).long(),
            torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test).long(), config["train"])


class System:
    """One system's model and what it carries from epoch to epoch: the SMA learners
    (``LearnerState``), or the SGD optimizer of ``one_b64_kept``."""

    def __init__(self, task: Any, batch: int, learners: int, keep_momentum: bool = False,
                 sma: tuple[float, float] = (0.25, 0.5)) -> None:
        self.module, self.batch, self.learners = task.build_model(), batch, learners
        self.sma = sma  # (alpha, mu)
        self.state = LearnerState()
        self.optimizer: torch.optim.Optimizer | None = None
        self.keep_momentum = keep_momentum

    def epoch(self, x: torch.Tensor, y: torch.Tensor, train_cfg: dict, seed: int) -> float:
        """Train one epoch (one silo round) in place; its seconds."""
        cfg = TrainConfig(local_epochs=1, batch_size=self.batch, lr=train_cfg["lr"],
                          optimizer="sgd", momentum=train_cfg["momentum"])
        t0 = time.perf_counter()
        if self.learners > 1:
            spec = LearnerSpec(self.learners, momentum=self.sma[1], correction=self.sma[0])
            train_learners(self.module, x, y, cfg, spec, seed=seed, state=self.state)
        elif self.keep_momentum:  # train()'s batches and steps, one optimizer throughout
            if self.optimizer is None:
                self.optimizer = make_optimizer(list(self.module.parameters()), cfg)
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
            for i in range(0, len(x), self.batch):
                idx = order[i:i + self.batch]
                self.optimizer.zero_grad()
                F.cross_entropy(self.module(x[idx]), y[idx]).backward()
                self.optimizer.step()
        else:
            train(self.module, x, y, cfg, seed=seed)
        return time.perf_counter() - t0


def systems(b: int, learners: int, kept: bool = False) -> dict[str, tuple[int, int, bool]]:
    """name -> (batch, learners, keep the optimizer's momentum across epochs)."""
    out = {f"sma_L{learners}_b{b}": (b, learners, False),
           f"one_b{b * learners}": (b * learners, 1, False), f"one_b{b}": (b, 1, False)}
    if kept:
        out[f"one_b{b * learners}_kept"] = (b * learners, 1, True)
    return out


def throughput(task: Any, x: torch.Tensor, y: torch.Tensor, train_cfg: dict, b: int,
               learners: int, repeats: int, sma: tuple[float, float]) -> dict[str, float]:
    """Samples per second of each system: the median of ``repeats`` alternated epochs."""
    runs = {name: System(task, *spec, sma=sma) for name, spec in systems(b, learners).items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats + 1):  # the first pass warms up
        for name, run in runs.items():
            s = run.epoch(x, y, train_cfg, seed=r)
            if r:
                seconds[name].append(s)
    return {name: len(x) / statistics.median(s) for name, s in seconds.items()}


def to_target(task: Any, x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor,
              yt: torch.Tensor, train_cfg: dict, b: int, learners: int, target: float,
              max_epochs: int, sma: tuple[float, float]) -> dict[str, dict[str, Any]]:
    """Each system's accuracy curve, and its training seconds and epochs to ``target``;
    the systems take their epochs in turn."""
    runs = {name: {"system": System(task, *spec, sma=sma), "seconds": 0.0, "curve": [],
                   "reached": None} for name, spec in systems(b, learners, True).items()}
    for epoch in range(1, max_epochs + 1):
        for run in runs.values():
            if run["reached"] is not None:
                continue
            run["seconds"] += run["system"].epoch(x, y, train_cfg, seed=epoch)
            _, acc = evaluate(run["system"].module, xt, yt)
            run["curve"].append([round(run["seconds"], 4), acc])
            if acc >= target:
                run["reached"] = {"epochs": epoch, "seconds": run["seconds"]}
    return {name: {k: v for k, v in run.items() if k != "system"} for name, run in runs.items()}


def plot(path: Path, rates: dict[str, float], per_seed: dict[int, dict[str, dict]],
         target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def color(name: str) -> str:  # one colour per kind of system, in every panel
        return ("tab:red" if name.startswith("sma") else "tab:orange" if name.endswith("_kept")
                else "tab:gray" if name in ("one_b8", "one_b16") else "tab:blue")

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))
    left.bar(list(rates), list(rates.values()), color=[color(n) for n in rates])
    left.set_ylabel("samples / s (one thread)")
    left.set_title("throughput")
    first = next(iter(per_seed))
    for name, run in per_seed[first].items():
        xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
        mid.plot(xs, ys, marker="o", label=name, color=color(name))
    mid.axhline(target, color="k", linestyle=":", label=f"target {target}")
    mid.set_xlabel("training seconds")
    mid.set_ylabel("test accuracy")
    mid.set_title(f"time to accuracy (seed {first})")
    mid.legend()
    names = list(per_seed[first])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        secs = [(run[name]["reached"] or {"seconds": math.nan})["seconds"]
                for run in per_seed.values()]
        right.bar([s + i * width for s in range(len(per_seed))], secs, width, label=name,
                  color=color(name))
    right.set_xticks([s + 0.4 - width / 2 for s in range(len(per_seed))],
                     [str(s) for s in per_seed])
    right.set_xlabel("seed")
    right.set_ylabel(f"training seconds to {target}")
    right.set_title("time to target, per seed")
    right.legend(fontsize="small")
    fig.suptitle("Crossbow's SMA learners in a silo (ratios; shared 2-core VM)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def seed_list(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def summary(per_seed: dict[int, dict[str, dict]], sma: str, big: str) -> dict[str, Any]:
    """Per seed: each system's epochs and seconds to the target, and the time ratio
    ``sma`` / ``big``; over the seeds: the median and the worst ratio."""
    rows, ratios = {}, []
    for seed, curves in per_seed.items():
        reached = {name: curves[name]["reached"] for name in (sma, big)}
        ratio = (reached[sma]["seconds"] / reached[big]["seconds"]
                 if reached[sma] and reached[big] else None)
        rows[seed] = {"reached": reached, "time_ratio": ratio}
        ratios.append(math.inf if ratio is None else ratio)
    median, worst = (statistics.median(ratios), max(ratios)) if ratios else (math.inf,) * 2
    return {"seeds": rows, "median_time_ratio": None if math.isinf(median) else median,
            "worst_time_ratio": None if math.isinf(worst) else worst}  # None: not reached


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few epochs, no plot")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--seeds", type=seed_list, default=seed_list("0-7"),
                        help="run seeds of the time-to-target runs, e.g. 0-2,5 (default 0-7)")
    parser.add_argument("--lr", type=float, default=None, help="train.lr of every system "
                        "(default: the scenario's)")
    parser.add_argument("--sma-correction", type=float, default=None,
                        help="alpha (default: silo.sma_correction's \"auto\", 1 / L)")
    parser.add_argument("--sma-momentum", type=float, default=SiloConfig().sma_momentum)
    parser.add_argument("--no-throughput", action="store_true", help="time to target only")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "crossbow.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sma = (args.sma_correction, args.sma_momentum)
    seeds = args.seeds[:1] if args.quick else args.seeds
    repeats, max_epochs = (1, 2) if args.quick else (args.repeats, args.max_epochs)
    rates: dict[str, float] = {}
    per_seed: dict[int, dict[str, dict]] = {}
    for seed in seeds:
        task, x, y, xt, yt, train_cfg = workload(seed)
        if args.lr is not None:
            train_cfg = {**train_cfg, "lr": args.lr}
        if seed == seeds[0] and not args.no_throughput:
            rates = throughput(task, x, y, train_cfg, 8, 4, repeats, sma)
        per_seed[seed] = to_target(task, x, y, xt, yt, train_cfg, 16, 4, args.target,
                                   max_epochs, sma)
    result = {
        "benchmark": "crossbow", "quick": args.quick, "examples": len(x),
        "sma_correction": sma[0] if sma[0] is not None else "auto",
        "sma_momentum": sma[1], "lr": train_cfg["lr"],
        "momentum": train_cfg["momentum"], "target": args.target, "seeds": seeds,
        "samples_per_s": rates,
        "throughput_ratio_L4_b8_over_one_b8": (rates["sma_L4_b8"] / rates["one_b8"]
                                               if rates else None),
        "to_target": {name: run for name, run in per_seed[seeds[0]].items()
                      if not name.endswith("_kept")},  # the first seed's curves
        "per_seed": summary(per_seed, "sma_L4_b16", "one_b64"),
        "per_seed_against_kept": summary(per_seed, "sma_L4_b16", "one_b64_kept"),
    }
    result["time_ratio_L4_b16_over_one_b64"] = result["per_seed"]["median_time_ratio"]
    if not args.quick:
        plot(args.plot, rates, per_seed, args.target)
        result["plot"] = str(args.plot.relative_to(ROOT)) if args.plot.is_relative_to(ROOT) \
            else str(args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
