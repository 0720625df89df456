"""Test accuracy against epsilon on digits, per DP mode, at equal noise multipliers, and
the time distributed DP adds to secure aggregation.

Runs the real ServerApp and ClientApp on the in-process engine for each
(mode, noise multiplier), reads the final accuracy and the ledger's epsilon, and
writes a plot. Distributed DP runs under secure aggregation; the same benchmark run
also trains once with secure aggregation and no DP, and compares the round times (and,
per client, encoding a delta with distributed DP against SecAgg's fixed-point
quantization). Prints human lines to stderr and one JSON object as the last stdout line.

    python benchmarks/dp_tradeoff.py            # full grid, plot in docs/dp_tradeoff.png
    python benchmarks/dp_tradeoff.py --quick    # one tiny run per mode (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.clientapp import ClientApp
from harness import WHOLE_PARTITIONS_OVERRIDE, timed_simulation
from machine_info import load_average, machine

from client.protocol.keys import ConfigKey, MetricKey
from client.secure_client import encode_distributed, quantize_into, register_secagg
from privacy.dp import DPConfig, plan_distributed_dp
from server.dp import DPController
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from server.store import Store
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid

# User-level DP needs many users: 700 users of 2 digits each, 30% sampled per round.
FULL = {"clients": 700, "rounds": 20, "noise": [0.5, 1.0, 2.0], "sample_fraction": 0.3,
        "overhead_z": 1.0, "encode_dims": [1_000_000], "round_repeats": 3}
# Quick: every client in every round, so that each secure round has enough participants.
QUICK = {"clients": 5, "rounds": 1, "noise": [0.5], "sample_fraction": 1.0,
         "overhead_z": 0.5, "encode_dims": [], "round_repeats": 1}
BASE = [WHOLE_PARTITIONS_OVERRIDE, "train.local_epochs=2", "train.batch_size=16", "train.lr=0.1",
        "train.momentum=0.0",
        "data.partitioner=iid", "aggregation.weight_by=uniform", "dp.delta=1e-5",
        "federation.sampling=poisson", "federation.checkpoint_every=0"]
SECURE = ["secagg.enabled=true"]  # secagg defaults: 32 bits, auto k, no dropouts
MODES = {
    "central": ["dp.mode=central", "dp.clip=0.3"],
    "central-adaptive": ["dp.mode=central", "dp.clip=adaptive", "dp.initial_clip=0.3",
                         "dp.target_quantile=0.5"],
    "local": ["dp.mode=local", "dp.clip=0.3"],
    "distributed": [*SECURE, "dp.mode=distributed", "dp.clip=0.3"],
}


def run_one(mode: str, z: float, grid: dict[str, Any], db: str) -> dict[str, Any]:
    """One training run; ``mode`` "none" (no DP) or "secagg" (secure aggregation, no DP)
    when ``z == 0``."""
    overrides = [*BASE, f"federation.clients={grid['clients']}",
                 f"federation.rounds={grid['rounds']}",
                 f"federation.sample_fraction={grid['sample_fraction']}"]
    if z > 0:
        overrides += [*MODES[mode], f"dp.noise_multiplier={z}"]
        if mode == "central-adaptive":  # count noise: the paper's m/20, at least z
            per_round = grid["clients"] * grid["sample_fraction"]
            overrides.append(f"dp.clipped_count_stddev={max(per_round / 20, z)}")
    elif mode == "secagg":
        overrides += SECURE
    config = load_scenario("default", overrides)
    summary, wall = timed_simulation(config, db)
    with Store(db) as store:
        ledger = store.privacy_ledger(summary["run_id"])
        rounds = [r for r in store.rounds(summary["run_id"]) if r.round >= 1]
    return {"mode": mode if z > 0 or mode == "secagg" else "none", "noise_multiplier": z,
            "epsilon": ledger[-1]["epsilon"] if ledger else None,
            "protects_against": ledger[-1]["protects_against"] if ledger else None,
            "relation": ledger[-1]["relation"] if ledger else None,
            "epsilon_replace_one": ledger[-1]["epsilon_replace_one"] if ledger else None,
            # local and distributed DP: the released model's (amplified) figure, where one
            # is stated (secret fixed-size cohorts)
            "epsilon_model": ledger[-1]["epsilon_model"] if ledger else None,
            "delta": ledger[-1]["delta"] if ledger else None,
            "accuracy": summary["final_accuracy"], "wall_s": round(wall, 2),
            "round_s": round(median(r.wall_s for r in rounds), 4),
            "round_statuses": sorted({r.status for r in rounds})}


def best_of(fn: Any, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def encode_cost(dim: int, clients: int) -> dict[str, Any]:
    """Per client, in this process: SecAgg's fixed-point quantization of a delta against
    distributed DP's encoding (clip, rotate, round, integer noise), both into 32-bit words."""
    delta = (np.random.default_rng(0).standard_normal(dim) * 0.01).astype(np.float32)
    words = np.empty(dim + 1, np.uint32)
    plan = plan_distributed_dp(clients, dim, 0.3, 1.0, 32)
    quantize = best_of(lambda: quantize_into(delta, 1.0, clip_range=1.0, scale=2.0**20,
                                             max_weight=1.0, rounding="nearest", out=words))
    encode = best_of(lambda: encode_distributed(delta, plan, rotation_seed=1))
    return {"dim": dim, "words": plan.padded_dim, "quantize_ms": round(quantize * 1e3, 3),
            "distributed_ms": round(encode * 1e3, 3), "ratio": round(encode / quantize, 2)}


class _Fixed:
    def __init__(self, delta: np.ndarray) -> None:
        self.delta = delta
        self.metrics = MetricRecord({MetricKey.NUM_EXAMPLES: 10})


def secure_round_cost(n: int, dim: int, z: float, repeats: int) -> dict[str, Any]:
    """One secure round of ``n`` clients with fixed deltas (no training), without DP and
    with distributed DP, alternated ``repeats`` times in this process; median wall times."""
    rng = np.random.default_rng(0)
    deltas = {node: (rng.standard_normal(dim) * 0.01).astype(np.float32)
              for node in range(1, n + 1)}
    app = ClientApp()
    register_secagg(app, lambda msg, ctx: _Fixed(deltas[int(ctx.node_id)]))
    dp = DPController(DPConfig(mode="distributed", clip=0.3, noise_multiplier=z),
                      clients=n, clients_per_round=n, sampling="fixed")
    dp.plan_distributed(dim=dim, bits=32, max_clients=n)
    settings = SecAggScenarioConfig(enabled=True)

    def once(with_dp: bool) -> float:
        grid = InProcessGrid(app, n)
        t0 = time.perf_counter()
        session = SecAggSession(grid, settings, "uniform", 1, 600.0, 0.001,
                                dp if with_dp else None)
        out = session.run(list(deltas), 1,
                          TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), dim))
        if out.status != "completed":
            raise RuntimeError(f"secure round {out.status}: {out.abort_reason}")
        return time.perf_counter() - t0

    plain, noisy = [], []
    for _ in range(repeats):
        plain.append(once(False))
        noisy.append(once(True))
    return {"clients": n, "dim": dim, "words": dp.plan.padded_dim, "repeats": repeats,
            # six significant digits: a quick run's rounds take milliseconds, and the
            # ratio must stay recomputable from the two times
            "secagg_s": float(f"{median(plain):.6g}"),
            "distributed_s": float(f"{median(noisy):.6g}"),
            "ratio": round(median(noisy) / median(plain), 3)}


def model_dim() -> int:
    """Parameters of the benchmark's model (the number of clients does not change it)."""
    from simulations.apps import build_task

    config = load_scenario("default", [*BASE, "federation.clients=2"])
    return int(build_task(config).initial_params()[0].size)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    baseline = [r["accuracy"] for r in results if r["mode"] == "none"]
    for mode in MODES:
        pts = sorted((r["epsilon_model"] or r["epsilon"], r["accuracy"])
                     for r in results if r["mode"] == mode)
        if pts:
            style = {"linestyle": "--", "marker": "x"} if mode == "distributed" else \
                {"marker": "o"}
            ax.plot(*zip(*pts, strict=True), label=mode, **style)
    if baseline:
        ax.axhline(baseline[0], color="gray", linestyle="--", label="no DP")
    ax.set(xscale="log", xlabel="epsilon against the released model (delta = 1e-5)",
           ylabel="test accuracy",
           title="digits: accuracy against privacy (user-level DP)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", default="docs/dp_tradeoff.png")
    args = parser.parse_args()
    grid = QUICK if args.quick else FULL
    results = []
    dim = model_dim()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'dp.db'}"
        if not args.quick:
            results.append(run_one("central", 0.0, grid, db))
        secure_only = run_one("secagg", 0.0, grid, db)
        print(json.dumps(secure_only), file=sys.stderr)
        for mode in MODES:
            for z in grid["noise"]:
                if z > 0:
                    results.append(run_one(mode, z, grid, db))
                    print(json.dumps(results[-1]), file=sys.stderr)
    distributed = next(r for r in results if r["mode"] == "distributed"
                       and r["noise_multiplier"] == grid["overhead_z"])
    per_round = round(grid["clients"] * grid["sample_fraction"])
    overhead = {
        "noise_multiplier": grid["overhead_z"],
        "secure_round": secure_round_cost(per_round, dim, grid["overhead_z"],
                                          grid["round_repeats"]),
        "training_runs": {
            "secagg_round_s": secure_only["round_s"],
            "distributed_round_s": distributed["round_s"],
            "round_ratio": round(distributed["round_s"] / secure_only["round_s"], 3),
            "secagg_accuracy": secure_only["accuracy"]},
        "client_encoding": [encode_cost(d, per_round) for d in [dim, *grid["encode_dims"]]],
    }
    print(json.dumps(overhead), file=sys.stderr)
    if not args.quick:
        plot(results, Path(args.plot))
    print(json.dumps({"benchmark": "dp_tradeoff", "quick": args.quick,
                      "clients": grid["clients"], "rounds": grid["rounds"],
                      "sample_fraction": grid["sample_fraction"], "sampling": "poisson",
                      "results": results, "overhead": overhead,
                      "settings": BASE, "modes": MODES,
                      "machine": machine(),
                      "loadavg_before": load_before, "loadavg_after": load_average(),
                      "plot": None if args.quick else args.plot}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
