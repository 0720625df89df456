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
0.9 (``cc_bucketing_m``: the recommended setting before the seed study; the source paper
runs centered clipping with momentum), with server momentum alone (``cc_m``), after
nearest-neighbour mixing with uniform weights and server momentum 0.8 (``cc_nnm_m``,
f = 4: the recommended setting before ``cc_arc_nnm_m``), after adaptive robust clipping
and nearest-neighbour mixing with uniform weights and server momentum 0.7
(``cc_arc_nnm_m``, f = 4: the recommended setting), and centered clipping on the
clients under secure aggregation, without and with server momentum (``cc_secagg``, ``cc_secagg_m``;
``cc_secagg_mu``: with uniform weights and server momentum 0.8, the recommended secure
setting before ``cc_secagg_ml``: SecAgg+, one clipping step around the previous aggregate
with the radius set to the median update norm of that seed's attack-free FedAvg run, the
server sums; ``cc_secagg_ml``, the recommended secure setting: the same with uniform
weights, the clients clipping around the server's momentum buffer, server momentum 0.6
and server learning rate 2; ``mean_ml``: FedAvgM with that momentum and step and no
defence, the control that tells the larger step from the clipping). alie and
ipm need every honest update, which no one sees under secure aggregation: they do not run
there. Partitions are IID and Dirichlet(0.5) label skew (fedring's default).

Which cells run: ``--full`` runs every partitioner, seed, attack and combine. The default
plan fits a shared 2-core machine: on Dirichlet(0.5), every seed for FedAvg, FedAvgM and
the recommended settings (old and new) under every attack and every combine without
attackers, and the other combines under attack on the first seed; on IID, the
first seed for every cell. ``--quick`` (tests): IID, one seed, 2 rounds of one local
epoch, four attacks and six combines. ``--partitioners``, ``--attacks`` and
``--combines`` (comma-separated) keep only those cells of the plan (every seed with
``--full``); ``--client-momentum BETA`` runs the centered-clipping cells with worker
momentum (``aggregation.client_momentum``). Such a partial run writes no plot unless
``--plot`` is given.

Reported: the final central test accuracy per (partitioner, attack, combine) averaged
over the seeds run, the seeds behind each cell, a reference (outside quick mode): FedAvg
over the 16 honest clients alone, the attackers' updates dropped; every run with the
attackers its clients reported, the rounds that applied an aggregate and the updates not
accepted (a warning on stderr when a round applied nothing or an update was refused or
dropped), the targets and sanity checks; a heatmap goes to
docs/robustness.png.

Every seed (``--workload default``): the default scenario exactly as a user runs it (5
local epochs, lr 0.05, momentum 0.9, Dirichlet(0.5), each client's held-out split kept
out of training; ``short`` is the 2-epoch workload above), every chosen attack and
combine on every seed (``--seeds 0-9``; default: FedAvg, FedAvgM and the recommended
settings, old and new), with attack-free FedAvg on each seed. For every cell: the mean,
the worst seed, the spread (std, min-max) and the gap to attack-free FedAvg on the same
seed (per seed, mean and worst), a Markdown table of them on stderr, the issue's targets
per cell, and the per-seed gaps plotted to docs/robustness_seeds.png. ``--diagnose``
adds each seed's partition facts (the attackers' share of the examples and of each
class, the honest clients' label skew) and, for each centered-clipping run without
secure aggregation, each round's radius tau against the distances of the honest and
the attacker inputs to the centre (read by wrapping the combine, which it leaves as is).
``--set KEY=VALUE`` (repeatable) sets a scenario key on every cell but the FedAvg and
FedAvgM controls (candidate defences); ``--secure-radius-scale X`` sets client-side
clipping's radius to X times the seed's attack-free median update norm; ``--merge
A.json B.json`` rebuilds the tables, targets and plot from the runs of earlier outputs
(e.g. seed subsets run in parallel) without running anything.

    python benchmarks/robustness.py [--quick | --full] [--seeds 0-9 | 0,3,5 | N]
        [--workload short|default] [--diagnose] [--set KEY=VALUE ...]
        [--secure-radius-scale X] [--merge JSON ...] [--plot PATH]
        [--partitioners P,..] [--attacks A,..] [--combines C,..] [--client-momentum BETA]

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
# The default scenario exactly as a user runs it (5 local epochs, lr 0.05, momentum 0.9,
# Dirichlet(0.5), each client's held-out split kept out of training); only checkpoints,
# which do not change the training, are off.
DEFAULT_WORKLOAD = {"federation.checkpoint_every": 0}
WORKLOADS = {"short": WORKLOAD, "default": DEFAULT_WORKLOAD}
QUICK_SEED_WORKLOAD = {**DEFAULT_WORKLOAD, "federation.rounds": 2, "train.local_epochs": 1}
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
MOMENTUM_08 = {**SERVER_MOMENTUM, "aggregation.momentum": 0.8}  # the seed study's choice
MOMENTUM_07 = {**SERVER_MOMENTUM, "aggregation.momentum": 0.7}
# FedAvgM 0.6 with server learning rate 2: the secure setting's larger server step
MOMENTUM_06_LR2 = {**SERVER_MOMENTUM, "aggregation.momentum": 0.6, "aggregation.server_lr": 2.0}
COMBINES: dict[str, dict[str, Any]] = {
    "mean": {"aggregation.combine": "mean"},
    "mean_m": {"aggregation.combine": "mean", **SERVER_MOMENTUM},
    "mean_ml": {"aggregation.combine": "mean", **MOMENTUM_06_LR2},
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
    "cc_m": {"aggregation.combine": "centered_clip", **SERVER_MOMENTUM},
    "cc_nnm_m": {"aggregation.combine": "centered_clip", "aggregation.nnm": True,
                 "aggregation.f": F, "aggregation.weight_by": "uniform", **MOMENTUM_08},
    "cc_arc_nnm_m": {"aggregation.combine": "centered_clip", "aggregation.arc": True,
                     "aggregation.nnm": True, "aggregation.f": F,
                     "aggregation.weight_by": "uniform", **MOMENTUM_07},
    "cc_secagg": {"aggregation.combine": "centered_clip", "secagg.enabled": True},
    "cc_secagg_m": {"aggregation.combine": "centered_clip", "secagg.enabled": True,
                    **SERVER_MOMENTUM},
    "cc_secagg_mu": {"aggregation.combine": "centered_clip", "secagg.enabled": True,
                     "aggregation.weight_by": "uniform", **MOMENTUM_08},
    "cc_secagg_ml": {"aggregation.combine": "centered_clip", "secagg.enabled": True,
                     "aggregation.weight_by": "uniform", "aggregation.clip_center": "momentum",
                     **MOMENTUM_06_LR2},
}
# client-side clipping: the radius is set
SECURE_CC = ("cc_secagg", "cc_secagg_m", "cc_secagg_mu", "cc_secagg_ml")
CONTROLS = ("mean", "mean_m", "mean_ml")  # --set leaves these as they are
LABELS = {"mean": "FedAvg", "mean_m": "FedAvgM", "mean_ml": "FedAvgM 0.6, server lr 2",
          "median": "median",
          "median_b2": "median\n+ bucketing 2", "trimmed_mean": "trimmed mean",
          "trimmed_b2": "trimmed mean\n+ bucketing 2", "krum": "Krum", "bulyan": "Bulyan",
          "geometric_median": "geo. median", "centered_clip": "CC",
          "cc_bucketing": "CC + bucketing 2", "cc_bucketing_m": "CC + bucketing 2\n+ FedAvgM",
          "cc_m": "CC + FedAvgM", "cc_nnm_m": "NNM + CC + FedAvgM 0.8\n(uniform weights)",
          "cc_arc_nnm_m": "ARC + NNM + CC + FedAvgM 0.7\n(uniform weights)",
          "cc_secagg": "CC on clients\n(secagg)",
          "cc_secagg_m": "CC on clients\n(secagg) + FedAvgM",
          "cc_secagg_mu": "CC on clients (secagg)\n+ FedAvgM 0.8 (uniform weights)",
          "cc_secagg_ml": "CC on clients (secagg) around the momentum\n+ FedAvgM 0.6, "
                          "server lr 2 (uniform weights)"}
PARTITIONERS = ("iid", "dirichlet")
RECOMMENDED = ("mean", "mean_m", "cc_bucketing_m", "cc_secagg_m", "cc_nnm_m", "cc_secagg_mu",
               "cc_arc_nnm_m", "cc_secagg_ml")
# --workload default: the controls, the recommended settings and the ones they replace
SEED_COMBINES = ("mean", "mean_m", "cc_arc_nnm_m", "cc_nnm_m", "cc_secagg_ml", "cc_secagg_mu",
                 "cc_bucketing_m", "cc_secagg_m")
HELD_OUT = (10, 14)  # the seeds no setting was chosen on (seeds 0-9 chose them)
SEED_PLOT = ("cc_arc_nnm_m", "cc_secagg_ml", "cc_secagg_mu", "cc_nnm_m", "cc_bucketing_m",
             "cc_secagg_m")  # panels
QUICK_ATTACKS = ("none", "sign_flip", "alie", "ipm")
QUICK_COMBINES = ("mean", "geometric_median", "cc_bucketing_m", "cc_secagg_m", "cc_nnm_m",
                  "cc_secagg_mu")
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
    sets client-side centered clipping's radius. ``workload``: the scenario keys of every
    run; ``overrides``: keys set on every cell but the FedAvg and FedAvgM controls (the
    candidates measured with ``--set``); ``probe``: records each round of the
    centered-clipping runs (``--diagnose``); ``radius_scale``: client-side clipping's
    radius is that times the seed's attack-free median update norm."""

    def __init__(self, workload: dict[str, Any], folder: str, client_momentum: float = 0.0,
                 overrides: dict[str, Any] | None = None, probe: Probe | None = None,
                 radius_scale: float = 1.0) -> None:
        self.workload, self.folder, self.client_momentum = workload, folder, client_momentum
        self.overrides = overrides or {}
        self.radius_scale = radius_scale
        self.probe = probe
        self.radius: dict[tuple[str, int], float] = {}
        self.done: dict[tuple[str, int, str, str], dict[str, Any]] = {}

    def run(self, p: str, seed: int, attack: str, combine: str) -> dict[str, Any]:
        key = (p, seed, attack, combine)
        if key in self.done:
            return self.done[key]
        values = {**self.workload, "data.partitioner": p, **COMBINES[combine], "seed": seed}
        overrides = {} if combine in CONTROLS else self.overrides
        values.update(overrides)
        if combine in SECURE_CC:
            values["aggregation.clip_radius"] = round(
                self.radius_scale * self.clip_radius(p, seed), 4)
        if self.client_momentum and combine in MOMENTUM_COMBINES:
            values["aggregation.client_momentum"] = self.client_momentum
        if attack != "none":
            values.update({"attack.fraction": FRACTION, **ATTACKS[attack]})
        probe = self.probe if self.probe is not None and combine not in SECURE_CC \
            and values["aggregation.combine"] == "centered_clip" else None
        with probing(probe):
            r = run_one(values, key, self.folder)
        r["overrides"] = {**overrides, **({"radius_scale": self.radius_scale} if
                                          combine in SECURE_CC and self.radius_scale != 1
                                          else {})}
        if probe is not None:
            r["rounds"] = probe.take()
        self.done[key] = r
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
           "wall_s": round(wall, 2), "versions": summary["versions"],
           "not_accepted": sum(u.fate != "accepted" for u in updates)}
    if summary["versions"] != config["federation"]["rounds"] or out["not_accepted"]:
        log(f"  WARNING {key}: {summary['versions']} of {config['federation']['rounds']} "
            f"rounds applied, {out['not_accepted']} updates not accepted")
    if norms:
        out["median_update_norm"] = round(statistics.median(norms), 4)
    if combine in SECURE_CC:
        out["clip_radius"] = values["aggregation.clip_radius"]
    out["client_momentum"] = config["aggregation"]["client_momentum"]
    out["server_opt"] = config["aggregation"]["server_opt"]
    return out


def honest_only(p: str, seed: int, workload: dict[str, Any], folder: str) -> float:
    """Reference: FedAvg over the honest clients alone (the sign-flip attackers' updates
    dropped before the combine), the accuracy a perfect filter would keep; the attackers'
    own data is lost with them, which costs accuracy under label skew."""
    from flwr.app import Context, RecordDict

    from server.app import make_server_app
    from simulations.apps import build_task, client_app, config_from_run_config
    from simulations.config import load_scenario
    from simulations.inprocess import InProcessGrid

    values = {**workload, "data.partitioner": p, "seed": seed,
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


class Probe:
    """Records each aggregation of a centered-clipping run: which inputs carry an attacker
    (an update, or a bucket holding one), their distances to the centre, the first
    iteration's radius tau, the honest updates' spread and how far the result lands from
    the honest clients' mean. Installed by :func:`probing`; reads, never changes, a run."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []
        self.updates: list[Any] = []  # this aggregation's updates, in submission order
        self.order: Any = None  # bucketing's permutation and size, when it buckets

    def take(self) -> list[dict[str, Any]]:
        rounds, self.rounds = self.rounds, []
        return rounds

    def see_updates(self, updates: list[Any]) -> None:
        self.updates, self.order = list(updates), None

    def see_buckets(self, order: Any, size: int) -> None:
        self.order = (order, size)

    def see_combine(self, clip: Any, x: Any, out: Any) -> None:
        import numpy as np

        bad = np.array([bool(u.metrics.get("attacker")) for u in self.updates])
        if len(bad) != len(self.order[0] if self.order else x):
            return  # an update was rejected: rows and clients no longer line up
        if self.order is not None:
            order, size = self.order
            rows_bad = np.array([bad[order[b * size:(b + 1) * size]].any()
                                 for b in range(x.shape[0])])
        else:
            rows_bad = bad
        v0 = np.zeros(x.shape[1]) if clip.center is None else clip.center.astype(np.float64)
        dist = np.linalg.norm(x.astype(np.float64) - v0, axis=1)
        tau = clip.radius_of(dist)  # the first iteration's
        deltas = np.stack([u.delta for u in self.updates]).astype(np.float64)
        n = np.array([float(u.num_examples) for u in self.updates])
        honest = deltas[~bad]
        honest_mean = (n[~bad] / n[~bad].sum()) @ honest
        spread = np.linalg.norm(honest - honest_mean, axis=1)
        step = out.astype(np.float64) - v0
        want = honest_mean - v0
        cos = float(step @ want / max(np.linalg.norm(step) * np.linalg.norm(want), 1e-30))
        self.rounds.append({
            "tau": round(tau, 4),
            "honest_to_center": _spread(dist[~rows_bad]),
            "attacker_to_center": _spread(dist[rows_bad]) if rows_bad.any() else None,
            "honest_clipped": round(float((dist[~rows_bad] > tau).mean()), 3),
            "honest_spread": _spread(spread),
            "honest_mean_norm": round(float(np.linalg.norm(honest_mean)), 4),
            "error_to_honest_mean": round(float(np.linalg.norm(out - honest_mean)), 4),
            "honest_step": round(float(np.linalg.norm(want)), 4),
            "cos_to_honest_step": round(cos, 3),
        })


def _spread(values: Any) -> dict[str, float]:
    """Median and largest of a set of distances."""
    return {"median": round(float(statistics.median(values)), 4),
            "max": round(float(max(values)), 4)}


@contextmanager
def probing(probe: Probe | None) -> Iterator[None]:
    """Within the block, the simulation's pre-combine hook shows each round's updates to
    ``probe`` (after any omniscient forgery: what the combine gets) and centered clipping
    and bucketing show it their inputs and result; all restored after. None: nothing
    installed."""
    if probe is None:
        yield
        return
    import simulations.attacks as attacks
    from aggregation.bucketing import Bucketing
    from aggregation.centered import CenteredClip

    forge_for, combine, buckets = (attacks.omniscient_attack, CenteredClip._combine,
                                   Bucketing._combine)

    def hook(config: Any) -> Any:
        forge = forge_for(config)

        def see(updates: list[Any]) -> list[Any]:
            out = forge(updates) if forge is not None else updates
            probe.see_updates(out)
            return out
        return see

    def clip_combine(self: Any, x: Any, w: Any) -> Any:
        out = combine(self, x, w)
        probe.see_combine(self, x, out)
        return out

    def bucket_combine(self: Any, x: Any, w: Any) -> Any:
        probe.see_buckets(self.order(x.shape[0]), self.size_for(x.shape[0]))
        return buckets(self, x, w)

    patched = ((attacks, "omniscient_attack", hook), (CenteredClip, "_combine", clip_combine),
               (Bucketing, "_combine", bucket_combine))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, new in patched:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def partition_facts(workload: dict[str, Any], seed: int) -> dict[str, Any]:
    """Who the seed's attackers are in the data: their share of the training examples and
    of each class, and how far each honest client's label mix is from the whole training
    set's (total variation distance, 0 = the same mix, 1 = disjoint)."""
    import numpy as np

    from simulations.attacks import choose_attackers
    from simulations.config import load_scenario
    from simulations.task import ScenarioTask

    task = ScenarioTask.from_config(load_scenario("default", values={
        **workload, "data.partitioner": "dirichlet", "seed": seed}))
    y, classes = task.dataset.y_train, task.dataset.num_classes
    counts = np.stack([np.bincount(y[task.split_indices(c)[0]], minlength=classes)
                       for c in range(CLIENTS)]).astype(float)
    bad = np.zeros(CLIENTS, dtype=bool)
    attackers = list(choose_attackers(FRACTION, CLIENTS, seed))
    bad[attackers] = True
    total = counts.sum(axis=0)
    whole = total / total.sum()
    mix = counts / counts.sum(axis=1, keepdims=True)
    tv = 0.5 * np.abs(mix - whole).sum(axis=1)
    class_share = counts[bad].sum(axis=0) / total
    return {
        "seed": seed, "attackers": attackers,
        "attacker_examples_share": round(float(counts[bad].sum() / counts.sum()), 3),
        "attacker_class_share": [round(float(v), 3) for v in class_share],
        "classes_mostly_attackers": [int(c) for c in np.flatnonzero(class_share >= 0.5)],
        "honest_class_examples_min": int(counts[~bad].sum(axis=0).min()),
        "honest_tv_mean": round(float(tv[~bad].mean()), 3),
        "honest_tv_max": round(float(tv[~bad].max()), 3),
        "attacker_tv_mean": round(float(tv[bad].mean()), 3),
    }


def cell_label(run: dict[str, Any]) -> str:
    """A run's cell: its combine, and the keys ``--set`` changed on it; a combine whose
    changed keys make it another named combine is labelled by that name."""
    overrides = run.get("overrides", {})
    if overrides and run["combine"] in COMBINES:
        keys = {**COMBINES[run["combine"]], **overrides}
        same = [name for name, values in COMBINES.items() if values == keys]
        if same:
            return same[0]
    extra = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return f"{run['combine']}[{extra}]" if extra else run["combine"]


def seed_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """partitioner -> attack -> cell -> over the seeds run: mean, worst seed, std, min-max,
    and the gap to attack-free FedAvg on the same seed (per seed, mean and worst)."""
    control = {(r["partitioner"], r["seed"]): r["accuracy"] for r in runs
               if (r["attack"], r["combine"]) == ("none", "mean") and not r.get("overrides")}
    out: dict[str, Any] = {}
    for r in runs:
        row = out.setdefault(r["partitioner"], {}).setdefault(r["attack"], {})
        row.setdefault(cell_label(r), []).append(r)
    for p, attacks in out.items():
        for cells in attacks.values():
            for label, cell in cells.items():
                acc = {r["seed"]: r["accuracy"] for r in cell}
                worst = min(acc, key=lambda s: (acc[s], s))
                gaps = {s: round(control[(p, s)] - v, 4) for s, v in acc.items()
                        if (p, s) in control}
                stats = {"seeds": sorted(acc), "mean": round(statistics.fmean(acc.values()), 4),
                         "worst": acc[worst], "worst_seed": worst,
                         "std": round(statistics.pstdev(acc.values()), 4),
                         "min": min(acc.values()), "max": max(acc.values()),
                         "accuracy": {str(s): acc[s] for s in sorted(acc)}}
                if gaps:
                    worst_gap = max(gaps, key=lambda s: (gaps[s], -s))
                    stats.update(gap={str(s): gaps[s] for s in sorted(gaps)},
                                 gap_mean=round(statistics.fmean(gaps.values()), 4),
                                 gap_worst=gaps[worst_gap], gap_worst_seed=worst_gap)
                cells[label] = stats
    return out


LIMITS = {"server": (0.03, 0.06), "secure": (0.05, 0.08), "none": 0.02}


def seed_targets(stats: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets over the seeds, for every cell but the controls, on one
    partitioner's statistics: under each attack the mean gap to attack-free FedAvg at most
    0.03 and the worst seed's at most 0.06 (0.05 and 0.08 under secure aggregation);
    without attackers at most 0.02 below FedAvg on every seed."""
    cells = {label for row in stats.values() for label in row} - set(CONTROLS)
    out: dict[str, Any] = {}
    for label in sorted(cells):
        secure = label.split("[")[0] in SECURE_CC
        mean_limit, worst_limit = LIMITS["secure" if secure else "server"]
        rows: dict[str, Any] = {}
        for attack, row in stats.items():
            cell = row.get(label)
            if cell is None or "gap" not in cell:
                continue
            if attack == "none":
                met = cell["gap_worst"] <= LIMITS["none"]
            else:
                met = cell["gap_mean"] <= mean_limit and cell["gap_worst"] <= worst_limit
            rows[attack] = {"gap_mean": cell["gap_mean"], "gap_worst": cell["gap_worst"],
                            "gap_worst_seed": cell["gap_worst_seed"], "met": met}
        out[label] = {"limits": {"mean": mean_limit, "worst": worst_limit,
                                 "none_every_seed": LIMITS["none"]},
                      "attacks": rows, "all_met": bool(rows) and all(
                          r["met"] for r in rows.values())}
    return out


def markdown(stats: dict[str, Any], label: str) -> str:
    """One cell's per-seed figures as a Markdown table, one row per attack."""
    lines = ["| attack | mean | worst (seed) | std | min-max | gap mean | gap worst (seed) |",
             "|---|---|---|---|---|---|---|"]
    for attack, row in stats.items():
        c = row.get(label)
        if c is None:
            continue
        gap = (f"{c['gap_mean']:+.3f} | {c['gap_worst']:+.3f} ({c['gap_worst_seed']})"
               if "gap" in c else "n/a | n/a")
        lines.append(f"| {attack} | {c['mean']:.3f} | {c['worst']:.3f} ({c['worst_seed']}) | "
                     f"{c['std']:.3f} | {c['min']:.3f}-{c['max']:.3f} | {gap} |")
    return "\n".join(lines)


def plot_seeds(stats: dict[str, Any], cells: list[str], path: Path, subtitle: str,
               held_out: tuple[int, int] | None = None) -> None:
    """One panel per cell: each attack's gap to attack-free FedAvg, seed by seed;
    ``held_out``: the (first, last) seeds no choice was made on, shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.9 * rows + 0.5),
                             squeeze=False, sharey=True)
    markers = dict(zip(ATTACKS, "osD^vPX", strict=True))
    colors = {a: f"C{i}" for i, a in enumerate(ATTACKS)}
    for ax, label in zip(axes.flat, cells, strict=False):
        secure = label.split("[")[0] in SECURE_CC
        for attack, row in stats.items():
            cell = row.get(label)
            if cell is None or "gap" not in cell:
                continue
            seeds = [int(s) for s in cell["gap"]]
            ax.plot(seeds, list(cell["gap"].values()), marker=markers[attack], lw=0.8,
                    color=colors[attack], label=attack)
        mean_limit, worst_limit = LIMITS["secure" if secure else "server"]
        ax.axhline(worst_limit, color="red", ls="--", lw=0.8)
        ax.axhline(mean_limit, color="orange", ls=":", lw=0.8)
        ax.axhline(0, color="grey", lw=0.5)
        if held_out is not None:
            ax.axvspan(held_out[0] - 0.5, held_out[1] + 0.5, color="grey", alpha=0.08)
        ax.set_title(LABELS.get(label, label).replace("\n", " "), fontsize=9)
        ax.set_xlabel("seed")
        ax.grid(alpha=0.3)
        ax.set_ylabel("attack-free FedAvg minus this")
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7, loc="upper left")
    shaded = f"; shaded: seeds {held_out[0]}-{held_out[1]}, held out" if held_out else ""
    fig.suptitle(f"digits, 20 clients, 4 attackers (20%): {subtitle}\ndashed: worst-seed "
                 f"target, dotted: mean target{shaded}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
                                         if c not in CONTROLS},
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


def set_value(text: str) -> tuple[str, Any]:
    """``--set KEY=VALUE``: a scenario key and its value read as TOML (0.5, 3, true, "x")."""
    import tomllib

    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"--set {text!r}: write KEY=VALUE, e.g. aggregation.clip_iterations=1")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: a string
    return key.strip(), value


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
    parser.add_argument("--workload", choices=list(WORKLOADS), default="short",
                        help="short: 2 local epochs on whole partitions (the tables up to "
                             "the seed study); default: the default scenario as a user runs "
                             "it, Dirichlet(0.5) only, every cell on every seed")
    parser.add_argument("--partitioners", type=names(PARTITIONERS), default=None)
    parser.add_argument("--attacks", type=names(ATTACKS), default=None)
    parser.add_argument("--combines", type=names(COMBINES), default=None)
    parser.add_argument("--client-momentum", type=float, default=0.0,
                        help="aggregation.client_momentum of the centered-clipping cells")
    parser.add_argument("--secure-radius-scale", type=float, default=1.0,
                        help="client-side clipping's radius: this times the median update "
                             "norm of the seed's attack-free FedAvg run")
    parser.add_argument("--set", type=set_value, action="append", default=[],
                        dest="overrides", metavar="KEY=VALUE",
                        help="a scenario key on every cell but FedAvg and FedAvgM")
    parser.add_argument("--diagnose", action="store_true",
                        help="record the partitions' label mix and each round of the "
                             "centered-clipping runs")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="tables and plot from the runs of earlier outputs (files "
                             "holding this benchmark's JSON line); runs nothing")


def seed_plan(seeds: list[int], attacks: tuple[str, ...] | None,
              combines: tuple[str, ...] | None) -> list[tuple[str, int, str, str]]:
    """The default workload's cells: Dirichlet(0.5), every seed, each chosen attack and
    combine (default: every attack; FedAvg, FedAvgM and the recommended settings), and
    attack-free FedAvg on each seed, the control every gap is taken to."""
    cells = [("dirichlet", s, "none", "mean") for s in seeds]
    for s in seeds:
        for a in attacks or tuple(ATTACKS):
            for c in combines or SEED_COMBINES:
                if applies(a, c) and ("dirichlet", s, a, c) not in cells:
                    cells.append(("dirichlet", s, a, c))
    return cells


def load_runs(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs (later files win on the same cell) and the summaries of earlier outputs."""
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    summaries = []
    for path in paths:
        summary = json.loads(Path(path).read_text().strip().splitlines()[-1])
        summaries.append(summary)
        for r in summary["runs"]:
            runs[(r["partitioner"], r["seed"], r["attack"], cell_label(r))] = r
    return list(runs.values()), summaries


def main() -> None:
    args = seeds_args(__doc__, "one seed, IID only, 2 rounds of one local epoch, four "
                      "attacks and six combines (with --workload default: the seed "
                      "study's cells, 2 rounds of one epoch)", "robustness.png",
                      more=options)
    quick, seeds = args.quick, args.seeds
    per_seed = args.workload == "default"
    workload = WORKLOADS[args.workload] if not quick else \
        QUICK_SEED_WORKLOAD if per_seed else QUICK_WORKLOAD
    overrides = dict(args.overrides)
    if per_seed:
        cells = seed_plan(seeds, args.attacks, args.combines)
    else:
        cells = [c for c in plan(quick, args.full, seeds) if all(
            chosen is None or value in chosen for value, chosen
            in zip((c[0], c[2], c[3]), (args.partitioners, args.attacks, args.combines),
                   strict=True))]
    partial = any(x is not None for x in (args.partitioners, args.attacks, args.combines)) \
        or bool(args.client_momentum) or bool(overrides) or args.secure_radius_scale != 1
    if "--plot" not in sys.argv and not quick:
        if partial:
            args.plot = None  # the docs' plots show the full benchmarks only
        elif per_seed or args.merge:
            args.plot = ROOT / "docs" / "robustness_seeds.png"
    started, load_before = time.perf_counter(), load_average()
    facts: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    if args.merge:
        runs, merged = load_runs(args.merge)
        seeds = sorted({r["seed"] for r in runs})
        per_seed = True
        log(f"robustness: {len(runs)} runs from {len(merged)} outputs, seeds {seeds}")
        facts = [f for m in merged for f in m.get("diagnosis", {}).get("partitions", [])]
        for m in merged:  # per seed in the seed study: seed subsets add up
            for p, value in m.get("honest_only_fedavg", {}).items():
                if isinstance(value, dict):
                    reference.setdefault(p, {}).update(value)
                else:
                    reference[p] = value
    else:
        log(f"robustness: {'quick' if quick else 'full' if args.full else 'default plan'}, "
            f"workload {args.workload}, seeds {seeds}, {len(cells)} cells, set {overrides}, "
            f"load average {load_before[0]:.2f}")
        probe = Probe() if args.diagnose else None
        with tempfile.TemporaryDirectory() as folder:
            runner = Runner(workload, folder, args.client_momentum, overrides, probe,
                            args.secure_radius_scale)
            runs = [runner.run(*cell) for cell in cells]
            runs = list(runner.done.values())  # with the controls the radius needed
            if per_seed:
                reference = {"dirichlet": {str(s): honest_only("dirichlet", s, workload, folder)
                                           for s in seeds}}
            elif not quick:
                reference = {p: round(statistics.fmean(
                    honest_only(p, s, workload, folder) for s in seeds), 4)
                    for p in dict.fromkeys(c[0] for c in cells)}
        if args.diagnose:
            facts = [partition_facts(workload, s) for s in seeds]
            for f in facts:
                log(f"  seed {f['seed']}: attackers {f['attackers']} hold "
                    f"{f['attacker_examples_share']:.0%} of the examples, classes mostly "
                    f"theirs {f['classes_mostly_attackers']}, honest TV mean "
                    f"{f['honest_tv_mean']}")
    log(f"honest-only FedAvg (reference): {reference}")
    results, cell_seeds = table(runs)
    stats = seed_stats(runs)
    checks = sanity(results["iid"]) if "iid" in results else {}
    goals = {} if per_seed else targets(results["dirichlet"], reference.get("dirichlet")) \
        if "dirichlet" in results else {}
    seed_goals = seed_targets(stats["dirichlet"]) if "dirichlet" in stats else {}
    for label in (stats["dirichlet"] and dict.fromkeys(
            c for row in stats["dirichlet"].values() for c in row)) if per_seed else ():
        log(f"{label}:\n{markdown(stats['dirichlet'], label)}")
    for label, goal in seed_goals.items():
        log(f"  {label}: " + ", ".join(
            f"{a} {g['gap_mean']:+.3f}/{g['gap_worst']:+.3f}{'' if g['met'] else ' MISSED'}"
            for a, g in goal["attacks"].items()))
    plot_path = args.plot
    if plot_path is not None and per_seed:
        shown = [c for c in (*SEED_PLOT, *sorted(seed_goals)) if c in seed_goals]
        plot_seeds(stats["dirichlet"], list(dict.fromkeys(shown)), plot_path,
                   f"the default scenario, gap to attack-free FedAvg on each seed "
                   f"{seeds[0]}-{seeds[-1]}",
                   HELD_OUT if set(range(HELD_OUT[0], HELD_OUT[1] + 1)) <= set(seeds)
                   else None)
        log(f"plot: {plot_path}")
    elif plot_path is not None:
        plot(results, plot_path, f"final accuracy after {WORKLOAD['federation.rounds']} "
                                 f"rounds, mean over the seeds run")
        log(f"plot: {plot_path}")
    if not per_seed:
        log(f"targets (Dirichlet 0.5): {goals}")
        log(f"sanity checks (IID): {checks}")
    summary = {
        "benchmark": "robustness", "quick": quick, "full": args.full, "seeds": seeds,
        "workload": {"name": args.workload, "dataset": "digits",
                     "model": "mlp[64]", **workload,
                     "partitioners": sorted({r["partitioner"] for r in runs}),
                     "attack.fraction": FRACTION, "attacks": ATTACKS, "combines": COMBINES,
                     "set": overrides, "client_momentum": args.client_momentum,
                     "secure_radius_scale": args.secure_radius_scale,
                     "momentum_combines": MOMENTUM_COMBINES if args.client_momentum else []},
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "results": results, "seeds_per_cell": cell_seeds, "per_seed": stats,
        "honest_only_fedavg": reference, "targets": goals, "seed_targets": seed_goals,
        "sanity": checks, "runs": runs,
        "plot": shown_path(plot_path, ROOT),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if facts:
        summary["diagnosis"] = {"partitions": facts}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
