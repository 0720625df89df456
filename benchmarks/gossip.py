"""Gossip averaging among silos (D-PSGD) against FedAvg: accuracy per round and per byte.

Workload: fedring's default scenario (digits over 20 clients, Dirichlet(0.5) label skew,
the MLP, 5 local epochs of SGD with momentum), every client every round, ``--rounds``
rounds (default 20), on the in-process engine (real ServerApp, silo ClientApps on threads,
each gossip exchange in real processes over gloo, SQLite store). Every client holds out
the same split of its partition (``data.client_test_fraction`` 0.2, seeded by the run
seed and its partition id) and trains on the rest, in every system:

- ``gossip_ring`` and ``gossip_random`` (``driver.kind = "gossip"``; ``gossip.topology``
  ring, or random with ``gossip.degree`` 4, a new graph each round): each silo evaluates
  its own mixed model on its own held-out split;
- ``fedavg`` (``driver.kind = "sync"``, the scenario's FedAvg weighted by examples): the
  clients train on the same training splits, and the global model is evaluated on every
  client's held-out split after each round.

The accuracy of a round is the mean over the 20 clients of their held-out accuracy, in
all three. Bytes on the wire per round count model vectors of 4 bytes per parameter:
gossip, every silo sends its model to each neighbour (plus the initial model sent once
to every silo, counted in the first round); FedAvg, every client downloads the model
and uploads its delta. Gossip's consensus measurement (two allreduces per round among
the silos) is reported apart (``measure_bytes``), and so are FedAvg's bytes as the
Grid counted them (with the .npy headers and metrics). Reported: per round accuracy,
bytes and the consensus distance; the rounds and bytes each gossip topology needs to
get within 0.03 of FedAvg's final accuracy (and FedAvg's own rounds and bytes to that
level), and the first round from which each stays there; the seconds a 20-silo exchange
takes without training (``exchange_s``: ring processes, group set-up, the exchange and
the two allreduces); a plot of accuracy against bytes goes to docs/gossip.png.

    python benchmarks/gossip.py [--quick] [--rounds N] [--plot PATH]

``--quick`` (tests): 4 clients, 2 rounds of one local epoch, no plot. Human-readable
lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness import log, timed_simulation
from machine_info import load_average, machine, shown_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WITHIN = 0.03
HOLDOUT = 0.2


def scenario(kind: str, rounds: int, quick: bool, topology: str = "ring") -> dict[str, Any]:
    """The default scenario for ``kind`` ("sync" or "gossip"), resolved."""
    from simulations.config import load_scenario

    values: dict[str, Any] = {"federation.rounds": rounds, "federation.checkpoint_every": 0,
                              "driver.kind": kind, "data.client_test_fraction": HOLDOUT}
    if quick:
        values.update({"federation.clients": 4, "train.local_epochs": 1})
    if kind == "gossip":
        values.update({"gossip.topology": topology, "gossip.degree": 4})
    return load_scenario("default", values=values)


class HeldOutEvaluation:
    """The server's task, evaluating the global model on every client's held-out split:
    ``accuracy`` and ``loss`` are the means over the clients, ``test_*`` the central
    test set's."""

    def __init__(self, task: Any, clients: int) -> None:
        self._task = task
        self.clients = clients
        self._model: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def evaluate(self, params: Any) -> dict[str, float]:
        from client.flat_model import FlatModel
        from client.training import evaluate

        central = self._task.evaluate(params)
        if self._model is None:
            self._model = FlatModel(self._task.build_model())
        self._model.load(params)
        accs, losses = [], []
        for pid in range(self.clients):
            loss, acc = evaluate(self._model.module, *self._task.client_test(pid))
            accs.append(acc)
            losses.append(loss)
        return {"accuracy": statistics.fmean(accs), "loss": statistics.fmean(losses),
                "test_accuracy": central["accuracy"], "test_loss": central["loss"]}


def run_fedavg(config: dict[str, Any], db: str) -> tuple[dict[str, Any], float]:
    """FedAvg on the training splits, evaluated on the held-out splits: summary, seconds."""
    from server.app import run_server
    from simulations.apps import build_task, client_app
    from simulations.inprocess import InProcessGrid

    clients = config["federation"]["clients"]
    started = time.perf_counter()
    summary = run_server(InProcessGrid(client_app, clients), config,
                         task=HeldOutEvaluation(build_task(config), clients), store_url=db)
    return summary, time.perf_counter() - started


def per_round(db: str, run_id: str, model_bytes: int, clients: int,
              gossip: bool) -> list[dict[str, Any]]:
    """Each training round's accuracy, bytes (model vectors) and, for gossip, the
    consensus distance."""
    from server.store import Store

    with Store(db) as store:
        rounds = [r for r in store.rounds(run_id) if r.round > 0]
    out = []
    for r in rounds:
        m = r.metrics
        row: dict[str, Any] = {"round": r.round, "status": r.status,
                               "accuracy": m.get("accuracy"), "wall_s": round(r.wall_s, 3)}
        if gossip:
            initial = clients * model_bytes if r.round == 1 else 0
            row.update(bytes=int(m.get("gossip_bytes", 0)) + initial,
                       measure_bytes=int(m.get("consensus_bytes", 0)),
                       consensus_distance=m.get("consensus_distance"),
                       edges=int(m.get("gossip_edges", 0)), ring_s=m.get("ring_s"))
        else:
            row.update(bytes=2 * r.num_accepted * model_bytes,
                       grid_bytes=int(m.get("bytes_up", 0) + m.get("bytes_down", 0)),
                       test_accuracy=m.get("test_accuracy"))
        out.append(row)
    return out


def reach(rows: list[dict[str, Any]], level: float, *, stay: bool = False) -> dict[str, Any]:
    """The first round whose accuracy is at least ``level`` (with ``stay``: from which on
    every round's is), and the bytes sent up to it."""
    sent, first, first_bytes = 0, None, None
    for row in rows:
        sent += row["bytes"]
        above = row["accuracy"] is not None and row["accuracy"] >= level
        if above and first is None:
            first, first_bytes = row["round"], sent
        elif not above and stay:
            first = first_bytes = None
    return {"round": first, "bytes": first_bytes}


def exchange_seconds(n: int, dim: int, trials: int = 3) -> float:
    """Median seconds for ``n`` silos (threads, each with its ring process) to mix a
    ``dim``-vector on a ring and measure the consensus distance: no training."""
    import numpy as np
    import torch.distributed as dist

    from aggregation.gossip import metropolis_hastings, ring_topology
    from client.protocol.ring import RingSpec
    from client.silo.gossip import mix
    from client.silo.ring import warm_up

    warm_up()
    adjacency = ring_topology(n)
    w = metropolis_hastings(adjacency)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    x = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    times = []
    for t in range(trials):
        failures: list[BaseException] = []

        def silo(rank: int, t: int = t, failures: list[BaseException] = failures) -> None:
            spec = RingSpec(host="127.0.0.1", port=store.port, prefix=f"t{t}", rank=rank,
                            size=n, join_timeout_s=60, ring_timeout_s=30)
            nbrs = tuple(sorted(adjacency[rank]))
            try:
                mix(x[rank], nbrs, tuple(w[rank, j] for j in nbrs), w[rank, rank], spec)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=silo, args=(r,)) for r in range(n)]
        started = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        times.append(time.perf_counter() - started)
        if failures:
            raise failures[0]
    return statistics.median(times)


def plot(path: Path, systems: dict[str, list[dict[str, Any]]], fedavg_final: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_round) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in systems.items():
        sent, xs = 0, []
        for row in rows:
            sent += row["bytes"]
            xs.append(sent / 1e6)
        acc = [row["accuracy"] for row in rows]
        by_bytes.plot(xs, acc, marker=".", label=name)
        by_round.plot([row["round"] for row in rows], acc, marker=".", label=name)
    for ax in (by_bytes, by_round):
        ax.axhline(fedavg_final - WITHIN, color="grey", linestyle=":", linewidth=1,
                   label=f"FedAvg's final - {WITHIN}")
        ax.set_ylabel("accuracy (mean over silos, own held-out split)")
        ax.grid(alpha=0.3)
    by_bytes.set_xlabel("model bytes on the wire, cumulative (MB)")
    by_round.set_xlabel("round")
    by_round.xaxis.get_major_locator().set_params(integer=True)
    by_bytes.legend(fontsize=8)
    fig.suptitle("Gossip (D-PSGD) vs FedAvg: digits, 20 silos, Dirichlet(0.5)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 clients, 2 rounds, no plot")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 20)")
    parser.add_argument("--plot", default=None, help="PNG path (default docs/gossip.png)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    rounds = args.rounds or (2 if args.quick else 20)
    plot_path = Path(args.plot) if args.plot else (None if args.quick
                                                    else ROOT / "docs" / "gossip.png")
    load_before = load_average()
    systems: dict[str, list[dict[str, Any]]] = {}
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        db = f"sqlite:///{Path(tmp) / 'gossip.db'}"
        fedavg_config = scenario("sync", rounds, args.quick)
        clients = fedavg_config["federation"]["clients"]
        from simulations.apps import build_task

        dim = build_task(fedavg_config).initial_params()[0].size
        model_bytes = 4 * dim
        summary, seconds = run_fedavg(fedavg_config, db)
        systems["fedavg"] = per_round(db, summary["run_id"], model_bytes, clients, False)
        runs["fedavg"] = {"status": summary["status"], "wall_s": round(seconds, 2)}
        log(f"fedavg: accuracy {summary['final_accuracy']:.4f} in {seconds:.1f} s")
        for topology in ("ring", "random"):
            config = scenario("gossip", rounds, args.quick, topology)
            summary, seconds = timed_simulation(config, db)
            name = f"gossip_{topology}"
            systems[name] = per_round(db, summary["run_id"], model_bytes, clients, True)
            runs[name] = {"status": summary["status"], "wall_s": round(seconds, 2)}
            log(f"{name}: accuracy {summary['final_accuracy']:.4f} in {seconds:.1f} s")
    fedavg_final = systems["fedavg"][-1]["accuracy"]
    level = fedavg_final - WITHIN
    reached = {name: reach(rows, level) for name, rows in systems.items()}
    stays = {name: reach(rows, level, stay=True) for name, rows in systems.items()}
    exchange_s = exchange_seconds(clients, dim, trials=1 if args.quick else 3)
    log(f"a {clients}-silo exchange without training: {exchange_s:.2f} s")
    if plot_path is not None:
        plot(plot_path, systems, fedavg_final)
    result = {
        "benchmark": "gossip", "quick": args.quick, "machine": machine(),
        "loadavg_before": load_before, "loadavg_after": load_average(),
        "workload": {"scenario": "default", "clients": clients, "rounds": rounds,
                     "parameters": dim, "client_test_fraction": HOLDOUT, "random_degree": 4,
                     "local_epochs": fedavg_config["train"]["local_epochs"]},
        "fedavg_final_accuracy": fedavg_final, "within": WITHIN, "level": level,
        "reached": reached, "reached_to_stay": stays,
        "bytes_per_round": {name: rows[-1]["bytes"] for name, rows in systems.items()},
        "final_accuracy": {name: rows[-1]["accuracy"] for name, rows in systems.items()},
        "exchange_s": round(exchange_s, 3), "runs": runs, "rounds": systems,
        "plot": shown_path(plot_path, ROOT),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
