"""Final test accuracy with 20% attackers, per attack and per combine.

Workload: digits over 20 clients, the default MLP, two local epochs, 10 rounds, every
client every round, on fedring's in-process engine (real ServerApp, ClientApp and SQLite
store). 4 of the 20 clients (20%, drawn from the seed) attack:

- sign_flip: they send -delta;
- scale: they send 10 * delta;
- gaussian_noise: they send N(0, 1) noise instead of their delta;
- label_flip: they train on labels y -> 9 - y.

Each attack, and a run without attackers, is aggregated with FedAvg (``mean``),
coordinate-wise ``median``, ``trimmed_mean`` (beta 0.2), ``krum`` and ``bulyan`` (both
with f = 4, the number of attackers). Partitions are IID (the robust combines' setting)
and Dirichlet(0.5) label skew (fedring's default, where Krum-style selection suffers even
without attackers). Reported: the final central test accuracy per (partitioner, attack,
combine), averaged over seeds, every run with the attackers its clients reported, and
sanity checks; a heatmap goes to docs/robustness.png.

    python benchmarks/robustness.py [--quick] [--seeds N] [--plot PATH]

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import log, seeds_args, timed_simulation
from machine_info import load_average, machine, shown_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENTS, FRACTION = 20, 0.2
WORKLOAD = {"federation.clients": CLIENTS, "federation.rounds": 10,
            "federation.sample_fraction": 1.0, "train.local_epochs": 2,
            "federation.checkpoint_every": 0}
QUICK_WORKLOAD = {**WORKLOAD, "federation.rounds": 2, "train.local_epochs": 1}
ATTACKS: dict[str, dict[str, Any]] = {
    "none": {},
    "sign_flip": {"attack.kind": "sign_flip", "attack.factor": 1.0},
    "scale": {"attack.kind": "scale", "attack.scale": 10.0},
    "gaussian_noise": {"attack.kind": "gaussian_noise", "attack.noise_std": 1.0,
                       "attack.noise_mode": "replace"},
    "label_flip": {"attack.kind": "label_flip", "attack.label_map": "reverse"},
}
F = round(FRACTION * CLIENTS)
COMBINES: dict[str, dict[str, Any]] = {
    "mean": {"aggregation.combine": "mean"},
    "median": {"aggregation.combine": "median"},
    "trimmed_mean": {"aggregation.combine": "trimmed_mean", "aggregation.trim_beta": FRACTION},
    "krum": {"aggregation.combine": "krum", "aggregation.f": F},
    "bulyan": {"aggregation.combine": "bulyan", "aggregation.f": F},
}
LABELS = {"mean": "FedAvg", "median": "median", "trimmed_mean": "trimmed mean",
          "krum": "Krum", "bulyan": "Bulyan"}
PARTITIONERS = ("iid", "dirichlet")


def run_one(partitioner: str, attack: str, combine: str, seed: int, quick: bool,
            folder: str) -> dict[str, Any]:
    """One run; its final accuracy and the attackers recorded in its update metrics."""
    from server.store import Store
    from simulations.attacks import choose_attackers
    from simulations.config import load_scenario

    values = {**(QUICK_WORKLOAD if quick else WORKLOAD), "data.partitioner": partitioner,
              **COMBINES[combine], "seed": seed}
    if attack != "none":
        values.update({"attack.fraction": FRACTION, **ATTACKS[attack]})
    config = load_scenario("default", values=values)
    db = f"sqlite:///{folder}/{partitioner}-{attack}-{combine}-{seed}.db"
    summary, wall = timed_simulation(config, db)
    with Store(db) as store:
        reported = sorted({int(u.metrics["fedring.partition-id"])
                           for _, u in store.updates(summary["run_id"])
                           if u.metrics.get("attacker")})
    expected = list(choose_attackers(FRACTION, CLIENTS, seed)) if attack != "none" else []
    if reported != expected:
        raise RuntimeError(f"{attack}/{combine}: clients {reported} reported attacking, "
                           f"expected {expected}")
    return {"partitioner": partitioner, "attack": attack, "combine": combine, "seed": seed,
            "accuracy": round(summary["final_accuracy"], 4), "attackers": reported,
            "wall_s": round(wall, 2)}


def table(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """partitioner -> attack -> combine -> accuracy averaged over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for p in dict.fromkeys(r["partitioner"] for r in runs):
        out[p] = {}
        for a in ATTACKS:
            out[p][a] = {c: round(statistics.fmean(r["accuracy"] for r in runs
                                                   if (r["partitioner"], r["attack"],
                                                       r["combine"]) == (p, a, c)), 4)
                         for c in COMBINES}
    return out


def sanity(acc: dict[str, dict[str, float]]) -> dict[str, bool]:
    """What the literature predicts on IID data with 20% attackers."""
    base = acc["none"]["mean"]
    return {
        "fedavg_collapses_under_scale": acc["scale"]["mean"] < 0.5 * base,
        "median_holds_under_scale": acc["scale"]["median"] > base - 0.05,
        "krum_holds_under_scale": acc["scale"]["krum"] > acc["none"]["krum"] - 0.05,
        "robust_beat_fedavg_under_noise": min(acc["gaussian_noise"][c]
                                              for c in ("median", "trimmed_mean", "bulyan"))
        > acc["gaussian_noise"]["mean"],
    }


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    parts = list(results)
    fig, axes = plt.subplots(1, len(parts), figsize=(4.6 * len(parts) + 1.4, 4.4),
                             squeeze=False, sharey=True)
    for ax, p in zip(axes[0], parts, strict=True):
        grid = np.array([[results[p][a][c] for c in COMBINES] for a in ATTACKS])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn")
        ax.set_xticks(range(len(COMBINES)), [LABELS[c] for c in COMBINES], rotation=30,
                      ha="right")
        ax.set_yticks(range(len(ATTACKS)), list(ATTACKS))
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=9)
        ax.set_title({"iid": "IID partitions", "dirichlet": "Dirichlet(0.5) label skew"}[p],
                     fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="final test accuracy")
    fig.suptitle(f"digits, 20 clients, 4 attackers (20%): {subtitle}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    args = seeds_args(__doc__, "one seed, IID only, 2 rounds of one local epoch",
                      "robustness.png")
    quick, seeds = args.quick, args.seeds
    partitioners = ("iid",) if quick else PARTITIONERS
    started, load_before = time.perf_counter(), load_average()
    log(f"robustness: {'quick' if quick else 'full'}, seeds {seeds}, "
        f"load average {load_before[0]:.2f}")
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for p in partitioners:
            for seed in seeds:
                for attack in ATTACKS:
                    for combine in COMBINES:
                        r = run_one(p, attack, combine, seed, quick, folder)
                        log(f"  {p:9s} seed {seed} {attack:14s} {combine:12s} "
                            f"accuracy {r['accuracy']:.4f} ({r['wall_s']} s)")
                        runs.append(r)
    results = table(runs)
    checks = sanity(results["iid"])
    plot_path = args.plot
    if plot_path is not None:
        plot(results, plot_path, f"final accuracy after {WORKLOAD['federation.rounds']} "
                                 f"rounds, mean of {len(seeds)} seeds")
        log(f"plot: {plot_path}")
    log(f"sanity checks (IID): {checks}")
    workload = QUICK_WORKLOAD if quick else WORKLOAD
    summary = {
        "benchmark": "robustness", "quick": quick, "seeds": seeds,
        "workload": {"dataset": "digits", "model": "mlp[64]", **workload,
                     "partitioners": list(partitioners), "attack.fraction": FRACTION,
                     "attacks": ATTACKS, "combines": COMBINES},
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "results": results, "sanity": checks, "runs": runs,
        "plot": shown_path(plot_path, ROOT),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
