"""The one-shot canary audit's epsilon beside the accountant's, and what the audit costs.

Trains the default scenario (digits, 20 clients, 10 rounds, MLP d = 4,810; one local
epoch instead of five, to keep the 24 runs short on a shared machine) with
``[audit] canaries = K`` on the in-process engine (real ServerApp, ClientApp, pipeline
and store) for: no DP, central DP and distributed DP (secure aggregation on) at z = 1,
clip 1, delta 1e-5, each with every client in every round (the default) and with Poisson
sampling at q = 0.5; and central DP with its noise stage silently halved (a planted bug
the audit should expose). Each row is repeated over seeds: DP noise and canaries come
from OS entropy, so the spread shows the estimate's statistical error.

Cost: the same central-DP run without and with canaries, alternated: wall and CPU time
(the process's, which a loaded machine disturbs far less than wall time) and the CPU time
spent inside the canary stage itself; and, without training, the canary stage's time
per round and the final estimate's time at d = 1M parameters.

    python benchmarks/privacy_audit.py            # full: 3 seeds per row
    python benchmarks/privacy_audit.py --quick    # one tiny run per mode (seconds)

Prints human lines to stderr and one JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median, pstdev
from typing import Any

import numpy as np
from harness import WHOLE_PARTITIONS_OVERRIDE, log, timed_simulation
from machine_info import load_average, machine

import server.dp
from privacy.dp.audit import audit_epsilon
from server.audit import CanaryAudit
from server.config import AuditConfig
from server.store import Store
from simulations.config import load_scenario

FULL = {"seeds": [0, 1, 2], "canaries": 100, "overrides": ["train.local_epochs=1"],
        "cost_dim": 1_000_000, "cost_repeats": 3}
QUICK = {"seeds": [0], "canaries": 10, "cost_dim": 10_000, "cost_repeats": 1,
         "overrides": ["federation.clients=5", "federation.rounds=2", "train.local_epochs=1"]}
DP = ["aggregation.weight_by=uniform", "dp.clip=1.0", "dp.noise_multiplier=1.0",
      "dp.delta=1e-5"]
POISSON_HALF = ["federation.sampling=poisson", "federation.sample_fraction=0.5"]
MODES: dict[str, list[str]] = {
    "none": [],
    "central": ["dp.mode=central", *DP],
    "central, q=0.5": ["dp.mode=central", *DP, *POISSON_HALF],
    "distributed": ["dp.mode=distributed", "secagg.enabled=true", *DP],
    "distributed, q=0.5": ["dp.mode=distributed", "secagg.enabled=true", *DP, *POISSON_HALF],
    "central, noise halved (bug)": ["dp.mode=central", *DP],
}
QUICK_MODES = ("none", "central", "distributed")


def halved_noise() -> Any:
    """Replace central DP's noise with half its std (the accountant still charges z)."""
    honest = server.dp.central_dp_mean

    def halved(clipped_sum: np.ndarray, count: float, clip: float, z: float,
               rng: np.random.Generator) -> np.ndarray:
        return honest(clipped_sum, count, clip, z / 2, rng)

    server.dp.central_dp_mean = halved
    return honest


AUDIT_CPU = [0.0]  # CPU seconds spent in the canary stage's methods (this process)


def _count_cpu(method: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            AUDIT_CPU[0] += time.thread_time() - started

    return timed


for _name in ("apply", "observe_round", "summary"):  # the audit's whole work in a run
    setattr(CanaryAudit, _name, _count_cpu(getattr(CanaryAudit, _name)))


def run_one(mode: str, seed: int, canaries: int, grid: dict[str, Any],
            db: str) -> dict[str, Any]:
    config = load_scenario("default", [WHOLE_PARTITIONS_OVERRIDE, *grid["overrides"], *MODES[mode],
                                       f"audit.canaries={canaries}"], values={"seed": seed})
    honest = halved_noise() if "halved" in mode else None
    AUDIT_CPU[0] = 0.0
    cpu = time.process_time()
    try:
        summary, wall = timed_simulation(config, db)
    finally:
        if honest is not None:
            server.dp.central_dp_mean = honest
    cpu = time.process_time() - cpu
    with Store(db) as store:
        rounds = [r for r in store.rounds(summary["run_id"]) if r.round >= 1]
    return {"mode": mode, "seed": seed, "canaries": canaries,
            "epsilon": summary.get("epsilon"), "epsilon_model": summary.get("epsilon_model"),
            "protects_against": summary.get("protects_against"),
            "epsilon_audit": summary.get("epsilon_audit"),
            "epsilon_audit_lower": summary.get("epsilon_audit_lower"),
            "epsilon_audit_reference": summary.get("epsilon_audit_reference"),
            "audit_flag": summary.get("audit_flag"),
            "audit_mu": summary.get("audit_mu"), "accuracy": summary["final_accuracy"],
            "wall_s": round(wall, 2), "round_s": round(median(r.wall_s for r in rounds), 4),
            "cpu_s": round(cpu, 3), "audit_cpu_s": round(AUDIT_CPU[0], 4)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the accountant's epsilon and the audit's mean, spread and range."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        audits = [r["epsilon_audit"] for r in rows if r["mode"] == mode]
        lowers = [r["epsilon_audit_lower"] for r in rows if r["mode"] == mode]
        first = next(r for r in rows if r["mode"] == mode)
        out.append({"mode": mode,
                    **{key: None if first[key] is None else round(first[key], 3)
                       for key in ("epsilon", "epsilon_model", "epsilon_audit_reference")},
                    "audit_lower_max": round(max(lowers), 3),
                    "flagged": sum(bool(r["audit_flag"]) for r in rows if r["mode"] == mode),
                    "protects_against": first["protects_against"],
                    "audit_mean": round(mean(audits), 3), "audit_std": round(pstdev(audits), 3),
                    "audit_min": round(min(audits), 3), "audit_max": round(max(audits), 3),
                    "accuracy": round(mean(r["accuracy"] for r in rows if r["mode"] == mode),
                                      4)})
    return out


def stage_cost(dim: int, canaries: int, repeats: int) -> dict[str, Any]:
    """Without training: one round of the canary stage (all K taking part) and the final
    estimate, at ``dim`` parameters; best of ``repeats``."""
    audit = CanaryAudit(AuditConfig(canaries=canaries, canary_norm=1.0), rate=1.0,
                        combine="sum")
    aggregate = np.zeros(dim, np.float32)
    t0 = time.perf_counter()
    audit.apply(aggregate, 1.0, 1)  # draws the K canaries
    draw = time.perf_counter() - t0
    per_round, estimate = [], []
    change = np.random.default_rng(0).standard_normal(dim).astype(np.float32)
    for _ in range(repeats):
        t0 = time.perf_counter()
        audit.apply(aggregate, 1.0, 1)
        per_round.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        audit_epsilon(change, audit.canaries, 1e-5)
        estimate.append(time.perf_counter() - t0)
    return {"dim": dim, "canaries": canaries, "memory_mb": round(canaries * dim * 4 / 2**20, 1),
            "draw_s": round(draw, 4), "round_s": round(min(per_round), 6),
            "estimate_s": round(min(estimate), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny run per mode")
    args = parser.parse_args()
    grid = QUICK if args.quick else FULL
    modes = QUICK_MODES if args.quick else tuple(MODES)
    load_before = load_average()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'audit.db'}"
        for mode in modes:
            for seed in grid["seeds"]:
                rows.append(run_one(mode, seed, grid["canaries"], grid, db))
                log(json.dumps(rows[-1]))
        # the cost: the same central-DP run without and with canaries, alternated
        pairs = [(run_one("central", 0, 0, grid, db), run_one("central", 0, grid["canaries"],
                                                              grid, db))
                 for _ in range(grid["cost_repeats"])]
    training = {"runs": len(pairs)}
    for key in ("wall_s", "round_s", "cpu_s"):
        training[f"{key}_without"] = round(median(a[key] for a, _ in pairs), 4)
        training[f"{key}_with"] = round(median(b[key] for _, b in pairs), 4)
    training["cpu_ratio"] = round(training["cpu_s_with"] / training["cpu_s_without"], 3)
    training["audit_cpu_s"] = round(median(b["audit_cpu_s"] for _, b in pairs), 4)
    training["audit_cpu_share"] = round(training["audit_cpu_s"] / training["cpu_s_with"], 5)
    cost = {"training_runs": training,
            "stage": stage_cost(grid["cost_dim"], grid["canaries"], grid["cost_repeats"])}
    log(json.dumps(cost))
    print(json.dumps({"benchmark": "privacy_audit", "quick": args.quick,
                      "canaries": grid["canaries"], "seeds": grid["seeds"],
                      "summary": summarize(rows), "results": rows, "cost": cost,
                      "settings": {"overrides": grid["overrides"], "modes": MODES},
                      "machine": machine(), "loadavg_before": load_before,
                      "loadavg_after": load_average()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
