"""Federated evaluation: FedBN against FedAvg under feature shift, the federated against
the central accuracy on the default scenario, and what an evaluation round costs.

- ``shift``: the feature-shift scenario (``simulations/scenarios/feature_shift.toml``:
  each client sees its inputs through its own affine distortion, a batch-norm MLP, every
  client evaluating after every round). Per seed, FedAvg (``aggregation.local_buffers =
  false``: the global model on each client's held-out split, ``federated_accuracy``) and
  FedBN (``true``: each client's own batch norm, ``federated_accuracy_personal``), at the
  scenario's strength and, as a control, without distortion (``data.feature_shift = 0``).
- ``default``: the default scenario with ``federation.evaluate_fraction = 1``: the
  example-weighted federated accuracy of the global model against the central accuracy,
  their 10th percentile and minimum; and in the same runs, each round's evaluation time
  (``federated_eval_s``, 20 clients) against the rest of the round (``wall_s`` minus it).

Every run is on the in-process engine (real ServerApp, ClientApp and store).

    python benchmarks/federated_eval.py                      # both modes, seeds 0-2, plot
    python benchmarks/federated_eval.py --mode shift --seeds 3 4 5 --plot /tmp/unseen.png
    python benchmarks/federated_eval.py --quick              # 5 clients, 2 rounds, no plot

Prints human lines to stderr and one JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from harness import ROOT, log, timed_simulation
from machine_info import load_average, machine, shown_path

from server.store import Store
from simulations.apps import build_task
from simulations.config import load_scenario
from simulations.feature_shift import client_distortion

SHIFT_SCENARIO = "feature_shift"
VARIANTS = {"fedavg": ["aggregation.local_buffers=false"],
            "fedbn": ["aggregation.local_buffers=true"]}
GAP_TARGET = 0.03  # FedBN's personal over FedAvg's federated accuracy, every seed
FIDELITY_TARGET = 0.02  # |federated - central| on the default scenario
COST_TARGET = 0.10  # evaluation time over the rest of the round, median over rounds
QUICK = ["federation.clients=5", "federation.rounds=2", "train.local_epochs=1"]
ROUND_KEYS = ("accuracy", "federated_accuracy", "federated_accuracy_p10",
              "federated_accuracy_p90", "federated_accuracy_min",
              "federated_accuracy_personal", "federated_accuracy_personal_p10",
              "federated_accuracy_personal_p90", "federated_accuracy_personal_min",
              "federated_clients", "federated_eval_s")


def run_rounds(scenario: str, overrides: list[str], seed: int, db: str,
               own_statistics: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run: its summary and, per training round, the figures of ``ROUND_KEYS`` that it
    recorded (None where absent) with the round's wall seconds; ``own_statistics``: the
    summary also has :func:`own_statistics_accuracy` of the final model."""
    config = load_scenario(scenario, overrides, values={"seed": seed})
    with contextlib.redirect_stdout(sys.stderr):
        summary, wall = timed_simulation(config, db)
    with Store(db) as store:
        records = [r for r in store.rounds(summary["run_id"]) if r.round >= 1]
        final = store.load_checkpoint(summary["run_id"]) if own_statistics else None
        answers = [e for _, e in store.evaluations(summary["run_id"], round=records[-1].round)
                   if e.fate == "accepted"]
    rows = [{"round": r.round, "wall_s": r.wall_s,
             **{k: r.metrics.get(k) for k in ROUND_KEYS}} for r in records]
    out = {"status": summary["status"], "run_wall_s": round(wall, 2),
           "clients": config["federation"]["clients"],
           "federated_examples": sum(e.num_examples or 0 for e in answers),
           "central_examples": len(build_task(config).load_test())}
    if final is not None:
        out["own_statistics"] = round(own_statistics_accuracy(config, final.params), 4)
    return out, rows


def own_statistics_accuracy(config: dict[str, Any], params: np.ndarray) -> float:
    """The model ``params`` on every client's held-out split, example-weighted, with its
    batch-norm running statistics recomputed on that client's own training inputs (one
    pass in training mode, cumulative average) and nothing else changed: what the model
    scores once the averaged statistics are replaced by each client's own."""
    import torch

    from client.flat_model import FlatModel
    from client.training import evaluate

    task = build_task(config)
    clients = config["federation"]["clients"]
    model = FlatModel(task.build_model())
    model.load(params)
    correct = total = 0.0
    for pid in range(clients):
        held = task.load_client_test(pid, clients)
        if held is None:
            continue
        module = copy.deepcopy(model.module)
        for layer in module.modules():
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
                layer.reset_running_stats()
                layer.momentum = None
        module.train()
        with torch.no_grad():
            module(task.load_partition(pid, clients).tensors[0])
        x, y = held.tensors
        _, accuracy = evaluate(module, x, y)
        correct += accuracy * len(y)
        total += len(y)
    return correct / total


def rounded(value: float | None, places: int = 4) -> float | None:
    return None if value is None else round(value, places)


def shift_mode(seeds: list[int], extra: list[str], control: bool, db: str) -> dict[str, Any]:
    """FedAvg's federated against FedBN's personal accuracy, per seed and strength."""
    strength = load_scenario(SHIFT_SCENARIO)["data"]["feature_shift"]
    strengths = [strength, 0.0] if control else [strength]
    runs, curves = [], {}
    for shift in strengths:
        for seed in seeds:
            for variant, overrides in VARIANTS.items():
                summary, rows = run_rounds(
                    SHIFT_SCENARIO, [*overrides, f"data.feature_shift={shift}", *extra],
                    seed, db, own_statistics=variant == "fedavg")
                last = rows[-1]
                run = {"strength": shift, "seed": seed, "variant": variant, **summary,
                       **{k: rounded(last[k]) for k in ROUND_KEYS if k != "federated_eval_s"}}
                log(json.dumps(run))
                runs.append(run)
                curves[f"{shift}/{seed}/{variant}"] = [
                    {k: rounded(row[k]) for k in ("round", "accuracy", "federated_accuracy",
                                                  "federated_accuracy_personal")}
                    for row in rows]
    gaps = []
    for shift in strengths:
        for seed in seeds:
            pair = {r["variant"]: r for r in runs if r["strength"] == shift and r["seed"] == seed}
            fedavg, fedbn = pair["fedavg"], pair["fedbn"]
            personal = fedbn["federated_accuracy_personal"]
            gaps.append({
                "strength": shift, "seed": seed,
                "fedavg_federated": fedavg["federated_accuracy"],
                "fedavg_federated_p10": fedavg["federated_accuracy_p10"],
                "fedbn_personal": personal,
                "fedbn_personal_p10": fedbn["federated_accuracy_personal_p10"],
                "fedbn_global_federated": fedbn["federated_accuracy"],
                "fedavg_own_statistics": fedavg.get("own_statistics"),
                "fedavg_central": fedavg["accuracy"], "fedbn_central": fedbn["accuracy"],
                "contrast_range": contrast_range(shift, seed, fedavg["clients"]),
                "gap": None if personal is None or fedavg["federated_accuracy"] is None
                else round(personal - fedavg["federated_accuracy"], 4)})
    shifted = [g["gap"] for g in gaps if g["strength"] == strength]
    return {"scenario": SHIFT_SCENARIO, "strength": strength, "runs": runs, "gaps": gaps,
            "curves": curves,
            "target": {"gap_at_least": GAP_TARGET, "smallest_gap": min(
                (g for g in shifted if g is not None), default=None),
                "met": None if None in shifted else all(g >= GAP_TARGET for g in shifted)}}


def contrast_range(strength: float, seed: int, clients: int) -> list[float]:
    """The smallest and largest contrast ``a_i`` among the clients' distortions."""
    contrasts = [math.exp(client_distortion(strength, seed, pid)[0]) for pid in range(clients)]
    return [round(min(contrasts), 3), round(max(contrasts), 3)]


def default_mode(seeds: list[int], extra: list[str], db: str) -> dict[str, Any]:
    """Federated against central accuracy, and each round's evaluation against training
    time, on the default scenario with every client evaluating every round."""
    rows_out, ratios_all = [], []
    for seed in seeds:
        summary, rows = run_rounds("default", ["federation.evaluate_fraction=1", *extra],
                                   seed, db)
        last = rows[-1]
        ratios = [row["federated_eval_s"] / (row["wall_s"] - row["federated_eval_s"])
                  for row in rows if row["federated_eval_s"] is not None
                  and row["wall_s"] > row["federated_eval_s"]]
        ratios_all += ratios
        federated, central = last["federated_accuracy"], last["accuracy"]
        row = {"seed": seed, **summary, "central": rounded(central),
               "federated": rounded(federated),
               "federated_p10": rounded(last["federated_accuracy_p10"]),
               "federated_min": rounded(last["federated_accuracy_min"]),
               "federated_clients": last["federated_clients"],
               "federated_examples": summary["federated_examples"],
               "central_examples": summary["central_examples"],
               "difference": None if federated is None else round(federated - central, 4),
               "eval_s_median": rounded(statistics.median(
                   [r["federated_eval_s"] for r in rows if r["federated_eval_s"] is not None]
               ) if ratios else None),
               "train_s_median": rounded(statistics.median(
                   [r["wall_s"] - (r["federated_eval_s"] or 0.0) for r in rows])),
               "eval_over_train_median": rounded(statistics.median(ratios) if ratios else None),
               "eval_over_train": [round(r, 4) for r in ratios],
               "round_s": [{"round": r["round"], "wall_s": round(r["wall_s"], 6),
                            "eval_s": rounded(r["federated_eval_s"], 6)} for r in rows]}
        log(json.dumps(row))
        rows_out.append(row)
    diffs = [r["difference"] for r in rows_out]
    median_ratio = statistics.median(ratios_all) if ratios_all else None
    return {"scenario": "default", "results": rows_out, "targets": {
        "fidelity": {"within": FIDELITY_TARGET,
                     "largest_difference": None if None in diffs else max(map(abs, diffs)),
                     "met": None if None in diffs
                     else all(abs(d) <= FIDELITY_TARGET for d in diffs)},
        "cost": {"below": COST_TARGET, "eval_over_train_median": rounded(median_ratio),
                 "met": None if median_ratio is None else median_ratio < COST_TARGET}}}


def plot(path: Path, shift: dict[str, Any]) -> None:
    """Per seed, accuracy per round (FedBN personal, FedAvg federated, both central); then
    the final gap per seed, shifted and without distortion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strength, curves = shift["strength"], shift["curves"]
    seeds = sorted({g["seed"] for g in shift["gaps"]})
    fig, axes = plt.subplots(1, len(seeds) + 1, figsize=(3.6 * (len(seeds) + 1), 3.6))
    lines = [("fedbn", "federated_accuracy_personal", "FedBN, personal (federated)", "-"),
             ("fedavg", "federated_accuracy", "FedAvg (federated)", "-"),
             ("fedbn", "accuracy", "FedBN, central (server's batch norm)", ":"),
             ("fedavg", "accuracy", "FedAvg, central", ":")]
    for ax, seed in zip(axes, seeds, strict=False):
        for variant, key, label, style in lines:
            rows = curves[f"{strength}/{seed}/{variant}"]
            ax.plot([r["round"] for r in rows], [r[key] for r in rows], style, marker=".",
                    label=label, color="C0" if variant == "fedbn" else "C1")
        ax.set_title(f"seed {seed}, feature shift {strength}")
        ax.set_xlabel("round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7, loc="lower right")
    bars = axes[-1]
    strengths = sorted({g["strength"] for g in shift["gaps"]}, reverse=True)
    width = 0.8 / len(strengths)
    for i, s in enumerate(strengths):
        gaps = [next(g["gap"] for g in shift["gaps"] if g["seed"] == seed
                     and g["strength"] == s) or 0.0 for seed in seeds]
        bars.bar([k + i * width for k in range(len(seeds))], gaps, width,
                 label=f"feature shift {s}", color="C0" if s else "grey")
    bars.axhline(GAP_TARGET, color="grey", linestyle=":", linewidth=1,
                 label=f"target {GAP_TARGET}")
    bars.axhline(0, color="black", linewidth=0.5)
    bars.set_xticks([k + width * (len(strengths) - 1) / 2 for k in range(len(seeds))],
                    [f"seed {s}" for s in seeds])
    bars.set_title("FedBN personal - FedAvg, final round")
    bars.legend(fontsize=7)
    bars.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 clients, 2 rounds, 1 seed")
    parser.add_argument("--mode", choices=("all", "shift", "default"), default="all")
    parser.add_argument("--seeds", type=int, nargs="*", default=None,
                        help="seeds (default 0 1 2; quick: 0)")
    parser.add_argument("--no-control", action="store_true",
                        help="shift: skip the runs without distortion")
    parser.add_argument("--plot", default=None,
                        help="PNG path (default docs/federated_eval.png; none in quick mode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    extra = QUICK if args.quick else []
    plot_path = (Path(args.plot) if args.plot else None if args.quick
                 else ROOT / "docs" / "federated_eval.png")
    before = load_average()
    result: dict[str, Any] = {"benchmark": "federated_eval", "quick": args.quick,
                              "mode": args.mode, "seeds": seeds}
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'federated_eval.db'}"
        if args.mode in ("all", "shift"):
            result["shift"] = shift_mode(seeds, extra, not (args.quick or args.no_control), db)
        if args.mode in ("all", "default"):
            result["default"] = default_mode(seeds, extra, db)
    if plot_path is not None and "shift" in result:
        plot(plot_path, result["shift"])
    result.update(plot=shown_path(plot_path if "shift" in result else None, ROOT),
                  machine=machine(), loadavg_before=before, loadavg_after=load_average())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
