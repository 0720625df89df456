"""Simulated time to a target test accuracy with 20% of the clients 10x slower.

Workload: digits over 20 clients with Dirichlet(0.5) label skew, the default MLP, one
local epoch; on the simulated clock a normal client trains for ``compute_s`` = 1 s times
a lognormal(0, 0.25) speed factor, and 4 of the 20 clients (20%) are 10x slower. Each
driver runs on fedring's in-process engine (real ServerApp, ClientApp and SQLite store)
until central test accuracy reaches the target:

- sync_fedavg: every client every round, no deadline (a round waits for the slowest);
- sync_deadline: the same with a 2 s deadline, late updates dropped (for reference:
  the stragglers' data then never counts);
- fedasync: FedAsync, alpha 0.6, s(tau) = (1 + tau)^-0.5, 20 clients at once;
- fedbuff: FedBuff, K = 10, the same s(tau), 20 clients at once, server lr 1;
- secure_fedbuff: the same FedBuff with ``[secagg] enabled``: each buffer of 10 is
  summed under SecAgg+ (full graph), s(tau) applied on the clients. The secure stages
  take no simulated time (they are not modelled on the clock; their measured wall time
  per buffer, in process, is reported as ``secure_s_per_buffer``).

Reported per driver and seed: simulated seconds to the target, applied aggregates,
client updates and wall seconds; medians over seeds; FedBuff's and secure FedBuff's
speed-ups over sync FedAvg (target: at least 2x). The plot (accuracy against simulated
time, first seed) goes to docs/stragglers.png.

    python benchmarks/stragglers.py [--quick] [--seeds N] [--target A] [--plot PATH]

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import WHOLE_PARTITIONS, log, seeds_args, timed_simulation
from machine_info import load_average, machine, shown_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOAD = {**WHOLE_PARTITIONS,
            "federation.clients": 20, "federation.sample_fraction": 1.0,
            "train.local_epochs": 1, "federation.checkpoint_every": 0,
            "clients.compute_s": 1.0, "clients.speed_sigma": 0.25,
            "clients.straggler_fraction": 0.2, "clients.straggler_slowdown": 10.0}
STALENESS = {"driver.staleness": "polynomial", "driver.staleness_a": 0.5}
DRIVERS: dict[str, dict[str, Any]] = {
    "sync_fedavg": {"driver.kind": "sync", "federation.rounds": 60},
    "sync_deadline": {"driver.kind": "sync", "driver.deadline_s": 2.0,
                      "driver.late_policy": "drop", "federation.rounds": 60},
    "fedasync": {"driver.kind": "fedasync", "driver.alpha": 0.6, **STALENESS,
                 "federation.rounds": 3000},
    "fedbuff": {"driver.kind": "fedbuff", "driver.buffer_size": 10, **STALENESS,
                "federation.rounds": 600},
    "secure_fedbuff": {"driver.kind": "fedbuff", "driver.buffer_size": 10, **STALENESS,
                       "federation.rounds": 600, "secagg.enabled": True,
                       "secagg.neighbors": "full"},
}
TARGET_SPEEDUP = 2.0


def run_driver(name: str, seed: int, target: float, folder: str) -> dict[str, Any]:
    """One run to the target; its summary and the (simulated time, accuracy) curve."""
    from server.store import Store
    from simulations.config import load_scenario

    values = {**WORKLOAD, **DRIVERS[name], "driver.target_accuracy": target, "seed": seed}
    config = load_scenario("default", values=values)
    db = f"sqlite:///{folder}/{name}-{seed}.db"
    summary, wall = timed_simulation(config, db)
    with Store(db) as store:
        rounds = store.rounds(summary["run_id"])
        updates = sum(r.num_replies for r in rounds)
        sessions = store.secagg_rounds(summary["run_id"])
    secure_s = (round(statistics.mean(sum(x["seconds"].values()) for x in sessions), 4)
                if sessions else None)
    curve = [(r.metrics.get("sim_time_s", 0.0), r.metrics["accuracy"]) for r in rounds
             if "accuracy" in r.metrics]
    reached = bool(summary.get("reached_target"))
    return {"driver": name, "seed": seed, "reached": reached,
            "time_to_target_s": round(summary["simulated_time"], 3) if reached else None,
            "simulated_time_s": round(summary["simulated_time"], 3),
            "versions": summary["versions"], "updates": updates,
            "final_accuracy": round(summary["final_accuracy"], 4),
            "wall_s": round(wall, 2), "secure_s_per_buffer": secure_s, "curve": curve}


def median(xs: list[float | None]) -> float | None:
    """Median, a run that never reached the target counting as infinitely slow."""
    m = statistics.median([math.inf if x is None else x for x in xs])
    return None if math.isinf(m) else m


def plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"sync_fedavg": "C0", "sync_deadline": "C7", "fedasync": "C2", "fedbuff": "C3",
              "secure_fedbuff": "C1"}
    lines = {"sync_deadline": "--", "secure_fedbuff": ":"}
    for r in runs:
        xs, ys = zip(*r["curve"], strict=True)
        label = (f"{r['driver']}: {r['time_to_target_s']:.0f} s" if r["reached"]
                 else f"{r['driver']}: not reached")
        ax.plot(xs, ys, color=styles[r["driver"]], label=label,
                linestyle=lines.get(r["driver"], "-"),
                linewidth=2.5 if r["driver"] == "secure_fedbuff" else 1.5)
    ax.axhline(target, color="k", linewidth=0.8, linestyle=":")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("central test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("digits, 20 clients, 20% of them 10x slower: time to "
                 f"{target:.0%} accuracy (seed {runs[0]['seed']})", fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = seeds_args(__doc__, "one seed, target 0.8, every driver but sync_deadline",
                      "stragglers.png",
                      more=lambda parser: parser.add_argument(
                          "--target", type=float, default=None,
                          help="target accuracy (default 0.9, quick 0.8)"))
    quick, seeds = args.quick, args.seeds
    target = args.target or (0.8 if quick else 0.9)
    names = [n for n in DRIVERS if not (quick and n == "sync_deadline")]
    started, load_before = time.perf_counter(), load_average()
    log(f"stragglers: {'quick' if quick else 'full'}, target {target}, seeds {seeds}, "
        f"load average {load_before[0]:.2f}")
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds:
            for name in names:
                r = run_driver(name, seed, target, folder)
                log(f"  seed {seed} {name:14s} time to {target}: {r['time_to_target_s']} s "
                    f"({r['versions']} aggregates, {r['updates']} updates, {r['wall_s']} s wall)")
                runs.append(r)
    drivers = {}
    for name in names:
        mine = [r for r in runs if r["driver"] == name]
        drivers[name] = {
            "time_to_target_s": median([r["time_to_target_s"] for r in mine]),
            "reached": sum(r["reached"] for r in mine), "runs": len(mine),
            "versions": statistics.median(r["versions"] for r in mine),
            "updates": statistics.median(r["updates"] for r in mine),
            "wall_s": round(sum(r["wall_s"] for r in mine), 2)}
        secure = [r["secure_s_per_buffer"] for r in mine if r["secure_s_per_buffer"]]
        if secure:
            drivers[name]["secure_s_per_buffer"] = round(statistics.median(secure), 4)
    sync_t, buff_t, secure_t = (drivers[n]["time_to_target_s"]
                                for n in ("sync_fedavg", "fedbuff", "secure_fedbuff"))
    speedup = round(sync_t / buff_t, 2) if sync_t and buff_t else None
    secure_speedup = round(sync_t / secure_t, 2) if sync_t and secure_t else None
    per_seed = [round(a["time_to_target_s"] / b["time_to_target_s"], 2)
                for a, b in zip([r for r in runs if r["driver"] == "sync_fedavg"],
                                [r for r in runs if r["driver"] == "fedbuff"], strict=True)
                if a["reached"] and b["reached"]]
    plot_path = args.plot
    if plot_path is not None:
        plot([r for r in runs if r["seed"] == seeds[0]], target, plot_path)
        log(f"plot: {plot_path}")
    log(f"fedbuff speed-up over sync FedAvg: {speedup}x (target >= {TARGET_SPEEDUP}x); "
        f"secure fedbuff: {secure_speedup}x")
    summary = {
        "benchmark": "stragglers", "quick": quick, "target_accuracy": target,
        "seeds": seeds,
        "workload": {"dataset": "digits", "partitioner": "dirichlet(0.5)", "model": "mlp[64]",
                     **WORKLOAD, "drivers": DRIVERS,
                     "secure_stages_on_the_clock": "not modelled (0 simulated s)"},
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "drivers": drivers,
        "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs],
        "fedbuff_speedup": speedup, "fedbuff_speedup_per_seed": per_seed,
        "secure_fedbuff_speedup": secure_speedup,
        "target": {"fedbuff_speedup_min": TARGET_SPEEDUP,
                   "met": None if speedup is None else speedup >= TARGET_SPEEDUP},
        "plot": shown_path(plot_path, ROOT),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
