"""Final test accuracy with 20% attackers, per attack and per combine.

Workload: digits over 20 clients, the default MLP, two local epochs, 10 rounds, every
client every round, on fedring's in-process engine (real ServerApp, ClientApp and SQLite
store). 4 of the 20 clients (20%, drawn from the seed) attack:

- sign_flip: they send -delta;
- scale: they send 10 * delta;
- gaussian_noise: they send N(0, 1) noise instead of their delta;
- label_flip: they train on labels y -> 9 - y;
- alie (Baruch et al. 2019): mean - z_max * std of the round's honest updates, z_max from
  n = 20 and m = 4 (0.385);
- ipm (Xie et al. 2020): -0.1 times the mean of the round's honest updates.

Each attack, and a run without attackers, is aggregated with FedAvg (``mean``), FedAvgM
(``mean_m``: the mean with server momentum 0.9, ``server_opt = "fedavgm"``), coordinate-wise
``median`` and ``trimmed_mean`` (beta 0.2), each also over buckets of 2, ``krum`` and
``bulyan`` (f = 4, the number of attackers), the ``geometric_median`` (RFA),
``centered_clip`` alone, with ``bucketing`` = 2, and with bucketing and server momentum
0.9 (``cc_bucketing_m``: the recommended setting; the source paper runs centered clipping
with momentum), and centered clipping on the clients under secure aggregation, without
and with server momentum (``cc_secagg``, ``cc_secagg_m``: SecAgg+, one clipping step
around the previous aggregate with the radius set to the median update norm of that
seed's attack-free FedAvg run, the server sums). alie and ipm need every honest update,
which no one sees under secure aggregation: they do not run there. Partitions are IID
and Dirichlet(0.5) label skew (fedring's default).

Which cells run: ``--full`` runs every partitioner, seed, attack and combine. The default
plan fits a shared 2-core machine: on Dirichlet(0.5), every seed for FedAvg, FedAvgM and
the two recommended settings (cc_bucketing_m, cc_secagg_m) under every attack and every combine
without attackers, and the other combines under attack on the first seed; on IID, the
first seed for every cell. ``--quick`` (tests): IID, one seed, 2 rounds of one local
epoch, four attacks and four combines. ``--partitioners``, ``--attacks`` and
``--combines`` (comma-separated) keep only those cells of the plan (every seed with
``--full``); ``--client-momentum BETA`` runs the centered-clipping cells with worker
momentum (``aggregation.client_momentum``). Such a partial run writes no plot unless
``--plot`` is given.

Reported: the final central test accuracy per (partitioner, attack, combine) averaged
over the seeds run, the seeds behind each cell, a reference (outside quick mode): FedAvg
over the 16 honest clients alone, the attackers' updates dropped; every run with the
attackers its clients reported, the targets and sanity checks; a heatmap goes to
docs/robustness.png.

    python benchmarks/robustness.py [--quick | --full] [--seeds N] [--plot PATH]
        [--partitioners P,..] [--attacks A,..] [--combines C,..] [--client-momentum BETA]

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

from harness import WHOLE_PARTITIONS, log, seeds_args, timed_simulation
from machine_info import load_average, machine, shown_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENTS, FRACTION = 20, 0.2
WORKLOAD = {**WHOLE_PARTITIONS,
            "federation.clients": CLIENTS, "federation.rounds": 10,
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
    "alie": {"attack.kind": "alie"},
    "ipm": {"attack.kind": "ipm", "attack.ipm_epsilon": 0.1},
}
OMNISCIENT = ("alie", "ipm")
F = round(FRACTION * CLIENTS)
SERVER_MOMENTUM = {"aggregation.server_opt": "fedavgm", "aggregation.momentum": 0.9}
COMBINES: dict[str, dict[str, Any]] = {
    "mean": {"aggregation.combine": "mean"},
    "mean_m": {"aggregation.combine": "mean", **SERVER_MOMENTUM},
    "median": {"aggregation.combine": "median"},
    "median_b2": {"aggregation.combine": "median", "aggregation.bucketing": 2},
    "trimmed_mean": {"aggregation.combine": "trimmed_mean", "aggregation.trim_beta": FRACTION},
    "trimmed_b2": {"aggregation.combine": "trimmed_mean", "aggregation.trim_beta": FRACTION,
                   "aggregation.bucketing": 2},
    "krum": {"aggregation.combine": "krum", "aggregation.f": F},
    "bulyan": {"aggregation.combine": "bulyan", "aggregation.f": F},
    "geometric_median": {"aggregation.combine": "geometric_median", "aggregation.f": F},
    "centered_clip": {"aggregation.combine": "centered_clip", "aggregation.f": F},
    "cc_bucketing": {"aggregation.combine": "centered_clip", "aggregation.bucketing": 2},
    "cc_bucketing_m": {"aggregation.combine": "centered_clip", "aggregation.bucketing": 2,
                       **SERVER_MOMENTUM},
    "cc_secagg": {"aggregation.combine": "centered_clip", "secagg.enabled": True},
    "cc_secagg_m": {"aggregation.combine": "centered_clip", "secagg.enabled": True,
                    **SERVER_MOMENTUM},
}
SECURE_CC = ("cc_secagg", "cc_secagg_m")  # client-side clipping: the radius is set
LABELS = {"mean": "FedAvg", "mean_m": "FedAvgM", "median": "median",
          "median_b2": "median\n+ bucketing 2", "trimmed_mean": "trimmed mean",
          "trimmed_b2": "trimmed mean\n+ bucketing 2", "krum": "Krum", "bulyan": "Bulyan",
          "geometric_median": "geo. median", "centered_clip": "CC",
          "cc_bucketing": "CC + bucketing 2", "cc_bucketing_m": "CC + bucketing 2\n+ FedAvgM",
          "cc_secagg": "CC on clients\n(secagg)",
          "cc_secagg_m": "CC on clients\n(secagg) + FedAvgM"}
PARTITIONERS = ("iid", "dirichlet")
RECOMMENDED = ("mean", "mean_m", "cc_bucketing_m", "cc_secagg_m")
QUICK_ATTACKS = ("none", "sign_flip", "alie", "ipm")
QUICK_COMBINES = ("mean", "geometric_median", "cc_bucketing_m", "cc_secagg_m")
MOMENTUM_COMBINES = ("centered_clip", "cc_bucketing", "cc_bucketing_m", "cc_secagg",
                     "cc_secagg_m")  # --client-momentum


def applies(attack: str, combine: str) -> bool:
    """Omniscient attacks need the honest updates, which secure aggregation hides."""
    return not (attack in OMNISCIENT and combine in SECURE_CC)


def plan(quick: bool, full: bool, seeds: list[int]) -> list[tuple[str, int, str, str]]:
    """The (partitioner, seed, attack, combine) cells to run, in order."""
    cells: list[tuple[str, int, str, str]] = []
    if quick:
        return [("iid", s, a, c) for s in seeds for a in QUICK_ATTACKS for c in QUICK_COMBINES
                if applies(a, c)]
    for p in PARTITIONERS:
        for s in seeds:
            for a in ATTACKS:
                for c in COMBINES:
                    first = s == seeds[0]
                    keep = full or (first if p == "iid" else
                                    first or a == "none" or c in RECOMMENDED)
                    if keep and applies(a, c):
                        cells.append((p, s, a, c))
    return cells


class Runner:
    """Runs cells; the attack-free FedAvg run of each (partitioner, seed) first, which
    sets client-side centered clipping's radius."""

    def __init__(self, quick: bool, folder: str, client_momentum: float = 0.0) -> None:
        self.quick, self.folder, self.client_momentum = quick, folder, client_momentum
        self.radius: dict[tuple[str, int], float] = {}
        self.done: dict[tuple[str, int, str, str], dict[str, Any]] = {}

    def run(self, p: str, seed: int, attack: str, combine: str) -> dict[str, Any]:
        key = (p, seed, attack, combine)
        if key in self.done:
            return self.done[key]
        values = {**(QUICK_WORKLOAD if self.quick else WORKLOAD), "data.partitioner": p,
                  **COMBINES[combine], "seed": seed}
        if combine in SECURE_CC:
            values["aggregation.clip_radius"] = self.clip_radius(p, seed)
        if self.client_momentum and combine in MOMENTUM_COMBINES:
            values["aggregation.client_momentum"] = self.client_momentum
        if attack != "none":
            values.update({"attack.fraction": FRACTION, **ATTACKS[attack]})
        self.done[key] = r = run_one(values, key, self.folder)
        log(f"  {p:9s} seed {seed} {attack:14s} {combine:16s} accuracy {r['accuracy']:.4f} "
            f"({r['wall_s']} s)")
        return r

    def clip_radius(self, p: str, seed: int) -> float:
        """The median norm of the honest updates of the attack-free FedAvg run: the scale
        of the honest inputs' distance to a centre, which the paper's radius follows."""
        if (p, seed) not in self.radius:
            control = self.run(p, seed, "none", "mean")
            self.radius[(p, seed)] = control["median_update_norm"]
        return self.radius[(p, seed)]


def run_one(values: dict[str, Any], key: tuple[str, int, str, str],
            folder: str) -> dict[str, Any]:
    """One run; its final accuracy and the attackers recorded in its update metrics."""
    from server.store import Store
    from simulations.attacks import choose_attackers
    from simulations.config import load_scenario

    p, seed, attack, combine = key
    config = load_scenario("default", values=values)
    db = f"sqlite:///{folder}/{p}-{attack}-{combine}-{seed}.db"
    summary, wall = timed_simulation(config, db)
    with Store(db) as store:
        updates = [u for _, u in store.updates(summary["run_id"])]
    reported = sorted({int(u.metrics["fedring.partition-id"]) for u in updates
                       if u.metrics.get("attacker")})
    norms = [u.norm for u in updates if u.fate == "accepted" and u.norm is not None]
    expected = list(choose_attackers(FRACTION, CLIENTS, seed)) if attack != "none" else []
    secure = bool(config["secagg"]["enabled"])
    if reported != expected and not (secure and not reported):  # secagg: no metrics
        raise RuntimeError(f"{attack}/{combine}: clients {reported} reported attacking, "
                           f"expected {expected}")
    out = {"partitioner": p, "attack": attack, "combine": combine, "seed": seed,
           "accuracy": round(summary["final_accuracy"], 4), "attackers": reported,
           "wall_s": round(wall, 2)}
    if norms:
        out["median_update_norm"] = round(statistics.median(norms), 4)
    if combine in SECURE_CC:
        out["clip_radius"] = values["aggregation.clip_radius"]
    out["client_momentum"] = config["aggregation"]["client_momentum"]
    out["server_opt"] = config["aggregation"]["server_opt"]
    return out


def honest_only(p: str, seed: int, quick: bool, folder: str) -> float:
    """Reference: FedAvg over the honest clients alone (the sign-flip attackers' updates
    dropped before the combine), the accuracy a perfect filter would keep; the attackers'
    own data is lost with them, which costs accuracy under label skew."""
    from flwr.app import Context, RecordDict

    from server.app import make_server_app
    from simulations.apps import build_task, client_app, config_from_run_config
    from simulations.config import load_scenario
    from simulations.inprocess import InProcessGrid

    values = {**(QUICK_WORKLOAD if quick else WORKLOAD), "data.partitioner": p, "seed": seed,
              "attack.fraction": FRACTION, **ATTACKS["sign_flip"]}
    config = load_scenario("default", values=values)
    result: dict[str, Any] = {}

    def drop(updates: list[Any]) -> list[Any]:
        return [u for u in updates if not u.metrics.get("attacker")]

    app = make_server_app(build_task, config_from_run_config, config=config,
                          store_url=f"sqlite:///{folder}/{p}-honest-only-{seed}.db",
                          on_summary=result.update, pre_combine=lambda _: drop)
    app(InProcessGrid(client_app, CLIENTS), Context(run_id=1, node_id=0, node_config={},
                                                    state=RecordDict(), run_config={}))
    return round(result["final_accuracy"], 4)


def table(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """partitioner -> attack -> combine -> accuracy averaged over the seeds run (None: not
    run), and the seeds behind each cell."""
    acc: dict[str, Any] = {}
    seeds: dict[str, Any] = {}
    for p in dict.fromkeys(r["partitioner"] for r in runs):
        acc[p], seeds[p] = {}, {}
        for a in ATTACKS:
            acc[p][a], seeds[p][a] = {}, {}
            for c in COMBINES:
                cell = [r for r in runs if (r["partitioner"], r["attack"], r["combine"])
                        == (p, a, c)]
                acc[p][a][c] = round(statistics.fmean(r["accuracy"] for r in cell), 4) \
                    if cell else None
                seeds[p][a][c] = sorted(r["seed"] for r in cell)
    return acc, seeds


def targets(acc: dict[str, dict[str, float | None]],
            reference: float | None = None) -> dict[str, Any]:
    """The issue's targets on one partitioner's table (Dirichlet(0.5)): each centered
    clipping setting's worst gap under attack to attack-free FedAvg, and to attack-free
    FedAvgM (the same server momentum, the like-for-like control); ``reference``: the
    honest-only FedAvg accuracy."""
    base = acc["none"]["mean"]
    if base is None:
        return {}

    def worst_gap(combine: str, control: float | None) -> float | None:
        gaps = [control - row[combine] for a, row in acc.items()
                if a != "none" and row.get(combine) is not None]
        return round(max(gaps), 4) if gaps and control is not None else None

    no_attack = {c: round(base - v, 4) for c, v in acc["none"].items()
                 if c != "mean" and v is not None}
    goals: dict[str, Any] = {"fedavg_no_attack": base,
                             "fedavgm_no_attack": acc["none"].get("mean_m")}
    for combine, limit in (("cc_bucketing", 0.03), ("cc_bucketing_m", 0.03),
                           ("cc_secagg", 0.05), ("cc_secagg_m", 0.05)):
        gap = worst_gap(combine, base)
        goals[f"{combine}_worst_gap"] = gap
        goals[f"{combine}_within_{limit}"] = gap is not None and gap <= limit
        if combine.endswith("_m"):
            like = worst_gap(combine, acc["none"].get("mean_m"))
            goals[f"{combine}_worst_gap_to_fedavgm"] = like
            goals[f"{combine}_within_{limit}_of_fedavgm"] = like is not None and like <= limit
    goals.update({
        "no_attack_loss_vs_fedavg": no_attack,
        "robust_no_attack_within_0.02": {c: g <= 0.02 for c, g in no_attack.items()
                                         if c != "mean_m"},
        "honest_only_fedavg": reference,
    })
    return goals


def sanity(acc: dict[str, dict[str, float | None]]) -> dict[str, bool]:
    """What the literature predicts on IID data with 20% attackers (none without the
    attack-free FedAvg cell)."""
    base = acc["none"]["mean"]
    if base is None:
        return {}

    def get(a: str, c: str) -> float:
        v = acc.get(a, {}).get(c)
        return float("nan") if v is None else v

    return {
        "fedavg_collapses_under_scale": get("scale", "mean") < 0.5 * base,
        "median_holds_under_scale": get("scale", "median") > base - 0.05,
        "krum_holds_under_scale": get("scale", "krum") > get("none", "krum") - 0.05,
        "cc_bucketing_holds_under_scale": get("scale", "cc_bucketing") > base - 0.05,
    }


def plot(results: dict[str, Any], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    parts = list(results)
    fig, axes = plt.subplots(1, len(parts), figsize=(10.5 * len(parts) + 1.4, 5.6),
                             squeeze=False, sharey=True)
    for ax, p in zip(axes[0], parts, strict=True):
        grid = np.array([[np.nan if results[p][a][c] is None else results[p][a][c]
                          for c in COMBINES] for a in ATTACKS], dtype=float)
        image = ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap="RdYlGn")
        ax.set_xticks(range(len(COMBINES)), [LABELS[c] for c in COMBINES], rotation=35,
                      ha="right", fontsize=8)
        ax.set_yticks(range(len(ATTACKS)), list(ATTACKS))
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                text = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8)
        ax.set_title({"iid": "IID partitions", "dirichlet": "Dirichlet(0.5) label skew"}[p],
                     fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="final test accuracy")
    fig.suptitle(f"digits, 20 clients, 4 attackers (20%): {subtitle}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def options(parser: Any) -> None:
    """The benchmark's own command-line options."""
    def names(known: tuple[str, ...] | dict[str, Any]) -> Any:
        def parse(text: str) -> tuple[str, ...]:
            chosen = tuple(text.split(","))
            unknown = [c for c in chosen if c not in known]
            if unknown:
                raise ValueError(f"unknown {unknown}, choose from {list(known)}")
            return chosen
        return parse

    parser.add_argument("--full", action="store_true",
                        help="every partitioner, seed, attack and combine")
    parser.add_argument("--partitioners", type=names(PARTITIONERS), default=None)
    parser.add_argument("--attacks", type=names(ATTACKS), default=None)
    parser.add_argument("--combines", type=names(COMBINES), default=None)
    parser.add_argument("--client-momentum", type=float, default=0.0,
                        help="aggregation.client_momentum of the centered-clipping cells")


def main() -> None:
    args = seeds_args(__doc__, "one seed, IID only, 2 rounds of one local epoch, four "
                      "attacks and four combines", "robustness.png",
                      more=options)
    quick, seeds = args.quick, args.seeds
    cells = [c for c in plan(quick, args.full, seeds) if all(
        chosen is None or value in chosen for value, chosen
        in zip((c[0], c[2], c[3]), (args.partitioners, args.attacks, args.combines),
               strict=True))]
    partial = any(x is not None for x in (args.partitioners, args.attacks, args.combines)) \
        or bool(args.client_momentum)
    if partial and "--plot" not in sys.argv:
        args.plot = None  # the docs' plot shows the full benchmark only
    started, load_before = time.perf_counter(), load_average()
    log(f"robustness: {'quick' if quick else 'full' if args.full else 'default plan'}, "
        f"seeds {seeds}, {len(cells)} cells, load average {load_before[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        runner = Runner(quick, folder, args.client_momentum)
        runs = [runner.run(*cell) for cell in cells]
        runs = list(runner.done.values())  # with the controls the radius needed
        reference = {} if quick else {
            p: statistics.fmean(honest_only(p, s, quick, folder) for s in seeds)
            for p in dict.fromkeys(c[0] for c in cells)}
    results, cell_seeds = table(runs)
    reference = {p: round(v, 4) for p, v in reference.items()}
    log(f"honest-only FedAvg (reference): {reference}")
    checks = sanity(results["iid"]) if "iid" in results else {}
    goals = targets(results["dirichlet"], reference.get("dirichlet")) \
        if "dirichlet" in results else {}
    plot_path = args.plot
    if plot_path is not None:
        plot(results, plot_path, f"final accuracy after {WORKLOAD['federation.rounds']} "
                                 f"rounds, mean over the seeds run")
        log(f"plot: {plot_path}")
    log(f"targets (Dirichlet 0.5): {goals}")
    log(f"sanity checks (IID): {checks}")
    workload = QUICK_WORKLOAD if quick else WORKLOAD
    summary = {
        "benchmark": "robustness", "quick": quick, "full": args.full, "seeds": seeds,
        "workload": {"dataset": "digits", "model": "mlp[64]", **workload,
                     "partitioners": sorted({c[0] for c in cells}),
                     "attack.fraction": FRACTION, "attacks": ATTACKS, "combines": COMBINES,
                     "client_momentum": args.client_momentum,
                     "momentum_combines": MOMENTUM_COMBINES if args.client_momentum else []},
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "results": results, "seeds_per_cell": cell_seeds,
        "honest_only_fedavg": reference, "targets": goals,
        "sanity": checks, "runs": runs,
        "plot": shown_path(plot_path, ROOT),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
