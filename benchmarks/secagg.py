"""Secure aggregation cost per round: fedring SecAgg+ against plain FedAvg and Flower's SecAgg+.

Every system runs on fedring's in-process engine (one process, clients one after the
other, no serialisation), with synthetic clients whose "training" returns a fixed
float32 delta of d coordinates, so only aggregation and protocol costs are measured:

- plain: fedring's FedAvg round (delta replies, streaming weighted mean, server step);
- fedring: ``server.secagg_session`` + ``client.secure_client`` with k = default_k(N)
  ("auto"), k = 3, and the full graph (k = N-1, SecAgg), each twice: with the clients
  quantizing and masking on the machine's cores (node config ``mask-threads``, the
  in-process engine's default) and on one thread ("auto_1t", "k3_1t", "full_1t");
- fedring malicious (``--security semi_honest,malicious``, the default): each fedring graph
  also against a server that lies (``[secagg] security = "malicious"``: signed key
  advertisements, the derived graph, the consistency check), the clients' identities from
  a simulated run's PKI (``simulations.secagg_pki``), alternated round by round with the
  semi-honest variant so that all see the same load. "_malicious": the clients of the
  process share the memo of verified signatures (``privacy.secagg.malicious.verify``: a
  pure function's results, keyed by the exact key, message and signature) and of graphs;
  "_malicious_per_client" against "_per_client" (semi-honest): that memo is emptied before
  each client message and the graph memos before each SETUP and PUBLIC_KEYS, so every
  client pays every Ed25519 verification and graph it would pay in its own process;
- flower: Flower 1.41's SecAggPlusWorkflow on its legacy path (DefaultWorkflow, FedAvg
  strategy, NumPyClient with ``secaggplus_mod``), num_shares = 3 (each client shares with
  2 neighbours), num_shares = fedring's automatic k at that N, made odd ("auto", threshold
  its t: Flower's ring gives each client num_shares // 2 peers on each side, so k peers
  for an even k, k - 1 for an odd one, as 2 for num_shares = 3) and num_shares = all
  (1.0). "3" and "auto" run once per repetition right after the
  fedring rounds of k = 3 and auto k (so that they see the same load; a Flower round
  stopped at ``--flower-limit`` is not repeated: its limit is a lower bound), "all" once.

Per configuration: round wall time, per-client CPU time (thread time inside the ClientApp
plus that of the worker threads it waited for, median over clients; the clients of the
process share the graph's memo, and ``graph_derivation_s`` is what deriving its own
neighbours costs a client in its own process), and for fedring the
secure overhead (client CPU minus plain's) next
to the PRG bound: the CPU time to expand (k+1) AES-128-CTR masks of d 32-bit words and
add them, measured right after each round so that overhead and bound see the same
machine load (the ratio reported is the median over the repetitions). With 10% of the
clients vanishing after sharing keys, the server's unmasking CPU time is set against the
CPU time to expand the dropped clients' pair masks, and against expanding every mask it
removes (those plus one self-mask per survivor: the floor). The survivors' masked
vectors are summed as they arrive, in the masked-input stage, so unmasking is
reconstruction plus mask removal. Each size starts with one untimed fedring round, so
the timed ones see the steady state of a running simulation (the clients' reused input
and reply buffers exist; a process's first round also pays their page faults). Prints
one JSON object.

    .venv/bin/python benchmarks/secagg.py            # full grid, 7 to 12 minutes here
    .venv/bin/python benchmarks/secagg.py --quick    # tiny N and d, fedring only (< 30 s)
    .venv/bin/python benchmarks/secagg.py --sizes 100x1000000 --variants k3 \
        --flower-shares 3 --no-dropouts              # one cell: k = 3 against num_shares=3
    .venv/bin/python benchmarks/secagg.py --sizes 100x1000000 --variants auto,k3 \
        --flower-shares 3 --no-dropouts              # malicious/semi-honest, and Flower
    .venv/bin/python benchmarks/secagg.py --cifar-model  # N = 100 at the size of the cifar10
                                                     # scenario's batch-norm CNN (quick: N = 4)
    .venv/bin/python benchmarks/secagg.py --sizes 100x100000,300x100000,1000x100000 \
        --variants auto_1t --security semi_honest --no-flower --no-dropouts
                                                     # N sweep: round time, client cost per N
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from aggregation import Pipeline, Update, Validate, Weight, WeightedMean
from aggregation.server_opt import FedAvg as FedAvgStep
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_array
from client.protocol.updates import delta_record, read_delta
from client.secure_client import register_secagg
from privacy.secagg import graph, malicious
from privacy.secagg.messages import Header, decode_shares_and_input, encode_share_keys, read_header
from privacy.secagg.prg import prg_bound
from privacy.secagg.stages import MsgType
from privacy.secagg.workers import cpu_seconds, default_threads
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid
from simulations.secagg_pki import make_pki

CLIP = 8.0  # Flower's default clipping range; deltas here are far inside it


# --------------------------------------------------------------------------- clients


class Synthetic:
    def __init__(self, delta: np.ndarray, examples: int) -> None:
        self.delta = delta
        self.metrics = MetricRecord({MetricKey.NUM_EXAMPLES: examples})


def make_inputs(n: int, d: int, seed: int = 0) -> dict[int, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return {node: ((rng.standard_normal(d) * 0.01).astype(np.float32),
                   int(rng.integers(20, 200))) for node in range(1, n + 1)}


class Timed:
    """Wraps a ClientApp: CPU time (``workers.cpu_seconds``: with the worker threads it
    waited for) and wall time per node, summed over messages."""

    def __init__(self, app: Callable[[Message, Context], Message],
                 vanish: Callable[[Message, Context], bool] | None = None) -> None:
        self.app, self.vanish = app, vanish
        self.shares_only: Callable[[Message, Context], bool] | None = None  # drop the vector
        self.own_caches = False  # True: empty the memos shared by clients before each message
        self.cpu: dict[int, float] = defaultdict(float)
        self.wall = 0.0

    def __call__(self, msg: Message, context: Context) -> Message:
        if self.vanish is not None and self.vanish(msg, context):
            raise ConnectionError("vanished")
        if self.own_caches:  # as if each client ran in its own process (untimed)
            forget_memos(graphs=secagg_kind(msg) in (MsgType.SETUP, MsgType.PUBLIC_KEYS))
        cpu, wall = cpu_seconds(), time.perf_counter()
        try:
            reply = self.app(msg, context)
            if self.shares_only is not None and self.shares_only(msg, context):
                reply = shares_alone(msg, reply)
            return reply
        finally:
            self.cpu[int(context.node_id)] += cpu_seconds() - cpu
            self.wall += time.perf_counter() - wall

    def reset(self) -> None:
        self.cpu.clear()
        self.wall = 0.0


def forget_memos(*, graphs: bool = True) -> None:
    """Empty the process-wide memos that clients share in one process: the malicious mode's
    verified signatures and, with ``graphs``, the neighbour graphs (both modes')."""
    malicious.forget()
    if graphs:
        malicious._core.cache_clear()
        graph._placement.cache_clear()


def shares_alone(msg: Message, reply: Message) -> Message:
    """A SHARES_AND_INPUT reply cut down to its SHARE_KEYS: a client that vanishes after
    sharing keys in the merged flow (its masked vector never leaves)."""
    vector = reply.content.get("secagg-vector") if not reply.has_error() else None
    if not isinstance(vector, ArrayRecord):
        return reply
    h, shares, _ = decode_shares_and_input(vector["masked"].data)
    payload = encode_share_keys(Header(MsgType.SHARE_KEYS, h.run_id, h.round_id, h.client_id),
                                shares)
    return Message(RecordDict({"secagg": ConfigRecord({"msg": payload})}), reply_to=msg)


def secagg_kind(msg: Message) -> MsgType | None:
    """The SecAgg+ message a Flower message carries, if any."""
    record = msg.content.get("secagg") if isinstance(msg.content, RecordDict) else None
    data = record.get("msg") if isinstance(record, ConfigRecord) else None
    return read_header(data).kind if isinstance(data, bytes) else None


def fedring_client_app(inputs: dict[int, tuple[np.ndarray, int]]) -> ClientApp:
    """Plain replies (train) and secure ones (train.secagg / query.secagg), same inputs."""
    app = ClientApp()

    def local(msg: Message, context: Context) -> Synthetic:
        delta, examples = inputs[int(context.node_id)]
        return Synthetic(delta, examples)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        update = local(msg, context)
        update.metrics[MetricKey.BASE_VERSION] = 0
        return Message(RecordDict({"delta": delta_record(update.delta),
                                   "metrics": update.metrics}), reply_to=msg)

    register_secagg(app, local)
    return app


def model(d: int) -> tuple[np.ndarray, ArrayRecord]:
    params = np.zeros(d, np.float32)
    return params, ArrayRecord({"w": npy_array(params)})


# --------------------------------------------------------------------------- rounds


def plain_round(grid: InProcessGrid, nodes: list[int], d: int) -> float:
    params, arrays = model(d)
    pipe = Pipeline(Validate(), Weight("examples"), WeightedMean(), FedAvgStep())
    started = time.perf_counter()
    config = ConfigRecord({"server-round": 1, ConfigKey.REPLY: "delta"})
    msgs = [Message(RecordDict({"arrays": arrays, "config": config}), n, "train", group_id="1")
            for n in nodes]
    agg = pipe.open_round(dim=d, version=0)
    for reply in grid.pull_messages(list(grid.push_messages(msgs))):
        m = reply.content["metrics"]
        agg.submit(Update(client_id=str(reply.metadata.src_node_id),
                          delta=read_delta(reply.content["delta"]),
                          num_examples=int(m[MetricKey.NUM_EXAMPLES]), base_version=0))
    pipe.apply(params, agg.finish())
    return time.perf_counter() - started


def fedring_round(grid: InProcessGrid, nodes: list[int], d: int,
                  settings: SecAggScenarioConfig, rnd: int) -> tuple[float, Any]:
    params, arrays = model(d)
    started = time.perf_counter()
    session = SecAggSession(grid, settings, "examples", 1, 3600.0, 0.001)
    out = session.run(nodes, rnd,
                      TrainStart(arrays, ConfigRecord({ConfigKey.SEED: 0, "server-round": rnd}), d))
    if out.status != "completed":
        raise RuntimeError(f"secure round aborted: {out.abort_reason}")
    params += (out.weighted_sum / out.total_weight).astype(np.float32)
    return time.perf_counter() - started, out


def flower_round(client_app: Timed, grid: InProcessGrid, n: int, d: int,
                 num_shares: int | float, threshold: int | None = None) -> float:
    """One round of Flower's SecAggPlusWorkflow; its fit-workflow wall time. ``threshold``:
    its reconstruction threshold (default 2 for 3 shares, else a majority of n)."""
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    if threshold is None:
        threshold = 2 if num_shares == 3 else n // 2 + 1
    inner = SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold,
                               clipping_range=CLIP)
    spent: list[float] = []

    def timed_fit(grid_: Any, context: Any) -> None:
        started = time.perf_counter()
        inner(grid_, context)
        spent.append(time.perf_counter() - started)

    strategy = flower_fedavg()(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n,
                               min_available_clients=n, initial_parameters=ndarrays_to_parameters(
                                   [np.zeros(d, np.float32)]))
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    DefaultWorkflow(fit_workflow=timed_fit)(grid, context)
    if not strategy.aggregated:
        raise RuntimeError("Flower's secure aggregation halted without a result")
    return spent[0]


def flower_fedavg() -> Any:
    """Flower's FedAvg, noting whether it aggregated (a halted SecAgg+ round does not)."""
    from flwr.server.strategy import FedAvg

    class Noting(FedAvg):
        aggregated = False

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            self.aggregated = bool(results)
            return super().aggregate_fit(server_round, results, failures)

    return Noting


def own_configs(app: Callable[[Message, Context], Message]
                ) -> Callable[[Message, Context], Message]:
    """Give each client its own ConfigRecords, as a serialising engine would.

    Flower's SecAggPlusWorkflow sends one shared RecordDict to every client and its
    ``secaggplus_mod`` pops keys from it; without a copy the second client finds no
    stage. Arrays stay shared (nothing mutates them); the copy is not timed.
    """

    def call(msg: Message, context: Context) -> Message:
        msg.content = RecordDict({k: ConfigRecord(dict(v)) if isinstance(v, ConfigRecord)
                                  else v for k, v in msg.content.items()})
        return app(msg, context)

    return call


def flower_client_app(inputs: dict[int, tuple[np.ndarray, int]]) -> ClientApp:
    from flwr.client import ClientApp as LegacyClientApp
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod

    class Client(NumPyClient):
        def __init__(self, delta: np.ndarray, examples: int) -> None:
            self.delta, self.examples = delta, examples

        def fit(self, parameters: list[np.ndarray], config: dict) -> tuple:
            return [self.delta], self.examples, {}

    def client_fn(context: Context) -> Any:
        return Client(*inputs[int(context.node_id)]).to_client()

    return LegacyClientApp(client_fn=client_fn, mods=[secaggplus_mod])


def flower_in_child(inputs: dict[int, tuple[np.ndarray, int]], n: int, d: int,
                    shares: int | float, limit: float,
                    threshold: int | None = None) -> dict[str, Any]:
    """Flower's round in a forked process, stopped after ``limit`` seconds."""
    reader, writer = mp.get_context("fork").Pipe(duplex=False)

    def child() -> None:
        logging.getLogger("flwr").setLevel(logging.ERROR)
        fapp = Timed(flower_client_app(inputs))
        grid = InProcessGrid(own_configs(fapp), n)
        cpu = time.process_time()
        try:
            wall = flower_round(fapp, grid, n, d, shares, threshold)
        except RuntimeError as exc:
            writer.send({"error": str(exc)})
            return
        writer.send({"round_s": wall, "round_cpu_s": time.process_time() - cpu,
                     "client_cpu_s": median_client_cpu(fapp)})

    proc = mp.get_context("fork").Process(target=child, daemon=True)
    proc.start()
    writer.close()
    out: dict[str, Any] = {"timed_out_after_s": limit}
    if reader.poll(limit):
        out = reader.recv()
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return out


# --------------------------------------------------------------------------- driver


def graph_seconds(n: int, k: int) -> float:
    """CPU seconds for one client to derive its own neighbours without the memo (the
    seed's permutation, a sort of n keys, and its row, O(k)): what a client in its own process pays
    on top of ``client_cpu_s`` (the clients of one process share the permutation); 0 for
    the full graph (nothing to derive)."""
    if k >= n - 1:
        return 0.0
    times = []
    for i in range(5):
        seed = bytes([i]) * 32
        graph._placement.cache_clear()
        start = time.process_time()
        graph.node_neighbours(n, k, seed, i % n)
        times.append(time.process_time() - start)
    graph._placement.cache_clear()
    return min(times)


def median_client_cpu(timed: Timed) -> float:
    return statistics.median(timed.cpu.values()) if timed.cpu else 0.0


# fedring's graphs: default k, k = 3, full graph; each with the clients quantizing and
# masking on the machine's cores (the in-process engine's default) and on one thread ("_1t")
GRAPHS = {"auto": "auto", "k3": 3, "full": "full"}
VARIANTS = (*GRAPHS, *(f"{g}_1t" for g in GRAPHS))
SECURITY = ("semi_honest", "malicious")
# suffix of a variant's name -> (security, each client with its own memos)
MODES = {"": ("semi_honest", False), "_per_client": ("semi_honest", True),
         "_malicious": ("malicious", False), "_malicious_per_client": ("malicious", True)}


def measure(n: int, d: int, *, reps: int, flower: bool, limit: float,
            log: Callable[[str], None], variants: tuple[str, ...] = VARIANTS,
            dropouts: bool = True, flower_shares: tuple[str, ...] = ("3", "all"),
            security: tuple[str, ...] = SECURITY) -> dict[str, Any]:
    inputs = make_inputs(n, d)
    nodes = list(range(1, n + 1))
    app = Timed(fedring_client_app(inputs))
    grid = InProcessGrid(app, n)
    row: dict[str, Any] = {"N": n, "d": d}

    walls, cpus = [], []
    for _ in range(reps):
        app.reset()
        walls.append(plain_round(grid, nodes, d))
        cpus.append(median_client_cpu(app))
    row["plain"] = {"round_s": min(walls), "client_cpu_s": min(cpus)}
    plain_cpu = min(cpus)
    log(f"N={n} d={d} plain {min(walls):.3f} s")

    one_thread = InProcessGrid(app, n, mask_threads=1)  # same clients, masking on one thread
    cores = default_threads()  # the in-process engine's mask-threads
    modes = {suffix: m for suffix, m in MODES.items() if m[0] in security  # the per-client
             and (suffix != "_per_client" or "malicious" in security)}  # twin of malicious
    grids = {(cores, False): grid, (1, False): one_thread}
    if "malicious" in security:  # the same clients, each with an identity of the run's PKI
        pki = make_pki(n)
        grids[(cores, True)] = InProcessGrid(app, n, pki=pki)
        grids[(1, True)] = InProcessGrid(app, n, mask_threads=1, pki=pki)
    auto_k, auto_t = SecAggScenarioConfig(enabled=True, neighbors="auto",
                                          clip_range=CLIP).graph(n)
    auto_shares = auto_k | 1  # Flower's num_shares is odd: num_shares // 2 peers each side
    # Flower paired with a fedring graph: run after its rounds in each repetition
    paired = {variant: cfg for variant, cfg in (("k3", ("flower_shares3", 3, 2)),
                                                ("auto", ("flower_shares_auto", auto_shares,
                                                          auto_t)))
              if flower and cfg[0].removeprefix("flower_shares").lstrip("_") in flower_shares}
    flower_runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    rnd = 1
    if variants:  # one untimed round first: the clients' reused buffers are then allocated
        for sec in dict.fromkeys(m[0] for m in modes.values()):
            rnd += 1
            warm = SecAggScenarioConfig(enabled=True, neighbors="auto", clip_range=CLIP,
                                        security=sec)
            fedring_round(grids[(cores, sec == "malicious")], nodes, d, warm, rnd)
    for variant in variants:
        neighbors = GRAPHS[variant.removesuffix("_1t")]
        threads = 1 if variant.endswith("_1t") else cores
        runs: dict[str, list[tuple[float, float, float, float, float, Any]]] = {
            suffix: [] for suffix in modes}
        for rep in range(reps):  # the modes alternate, each rep starting with the next one
            order = list(modes)[rep % len(modes):] + list(modes)[:rep % len(modes)]
            for suffix in order:
                sec, own = modes[suffix]
                settings = SecAggScenarioConfig(enabled=True, neighbors=neighbors,
                                                clip_range=CLIP, security=sec)
                rnd += 1
                app.reset()
                forget_memos()
                app.own_caches = own
                gc.collect()
                cpu = time.process_time()
                wall, out = fedring_round(grids[(threads, sec == "malicious")], nodes, d,
                                          settings, rnd)
                round_cpu = time.process_time() - cpu
                app.own_caches = False
                bound = prg_bound(d, out.k + 1)  # right after: the same machine load
                runs[suffix].append((wall, round_cpu, app.wall, median_client_cpu(app), bound,
                                     out))
            if variant in paired:  # Flower at the same k, under the same load
                fname, shares, threshold = paired[variant]
                if not any("round_s" not in f for f in flower_runs[fname]):
                    flower_runs[fname].append(flower_in_child(inputs, n, d, shares, limit,
                                                              threshold))
                    gc.collect()
        for suffix, got in runs.items():
            name = f"fedring_{variant}{suffix}"
            walls = [g[0] for g in got]
            cpus = [g[3] for g in got]
            best = walls.index(min(walls))
            stats = got[best][5]
            overhead = min(cpus) - plain_cpu
            ratios = [(g[3] - plain_cpu) / g[4] for g in got if g[4]]
            row[name] = {"k": stats.k, "t": stats.t, "mask_threads": threads,
                         "security": modes[suffix][0], "own_signature_memo": modes[suffix][1],
                         "round_s": min(walls), "round_s_each": walls,
                         "round_cpu_s": got[best][1], "server_s": min(walls) - got[best][2],
                         "client_cpu_s": min(cpus), "client_secure_overhead_s": overhead,
                         "prg_bound_s": min(g[4] for g in got),
                         "overhead_over_prg_each": ratios,
                         "overhead_over_prg": statistics.median(ratios) if ratios else None,
                         "graph_derivation_s": graph_seconds(n, stats.k),
                         "server_stage_s": stats.server_seconds}
            semi = runs.get(suffix.replace("_malicious", ""))
            if "_malicious" in suffix and semi:  # against the semi-honest twin, same reps
                row[name]["round_over_semi_honest"] = min(walls) / min(g[0] for g in semi)
                row[name]["round_over_semi_honest_each"] = [
                    g[0] / s[0] for g, s in zip(got, semi, strict=True)]
                row[name]["round_cpu_over_semi_honest"] = statistics.median(
                    g[1] / s[1] for g, s in zip(got, semi, strict=True))
                row[name]["client_cpu_over_semi_honest"] = min(cpus) / min(s[3] for s in semi)
            versus = (f", {row[name]['round_over_semi_honest']:.2f}x semi-honest (CPU "
                      f"{row[name]['round_cpu_over_semi_honest']:.2f}x)"
                      if "round_over_semi_honest" in row[name] else "")
            log(f"N={n} d={d} {name} k={stats.k} {min(walls):.3f} s "
                f"(round CPU {got[best][1]:.3f} s){versus}, client {min(cpus) * 1e3:.1f} ms "
                f"(overhead {overhead * 1e3:.1f} ms, PRG bound "
                f"{row[name]['prg_bound_s'] * 1e3:.1f} ms, "
                f"ratios {' '.join(f'{r:.2f}' for r in ratios)})")

    # 10% of the clients vanish after sharing keys: the server removes their pair masks
    # (in the merged flow they answer PUBLIC_KEYS with their shares alone)
    for name in [f"fedring_{v}" for v in ("auto", "full") if v in variants and dropouts
                 and "" in modes]:
        neighbors = GRAPHS[name.removeprefix("fedring_")]  # (k = 3, t = 2: not for 10% dropouts)
        count = max(1, round(0.1 * n))
        dropped = set(nodes[:: n // count][:count])

        def vanish(msg: Message, context: Context, dropped: set[int] = dropped) -> bool:
            if int(context.node_id) not in dropped or msg.metadata.message_type != \
                    "query.secagg":
                return False
            return read_header(msg.content["secagg"]["msg"]).kind is MsgType.FORWARDED_SHARES

        def shares_only(msg: Message, context: Context, dropped: set[int] = dropped) -> bool:
            return int(context.node_id) in dropped and secagg_kind(msg) is MsgType.PUBLIC_KEYS

        settings = SecAggScenarioConfig(enabled=True, neighbors=neighbors, clip_range=CLIP)
        runs = []
        for _ in range(min(reps, 2)):
            app.vanish, app.shares_only = vanish, shares_only
            rnd += 1
            _, out = fedring_round(grid, nodes, d, settings, rnd)
            app.vanish = app.shares_only = None
            pair = out.masks_removed - len(out.survivors)
            runs.append((out, prg_bound(d, pair, reps=1), prg_bound(d, out.masks_removed, reps=1)))
        out = runs[0][0]
        survivors = len(out.survivors)
        pair = out.masks_removed - survivors
        unmask = [o.server_seconds.get("unmasking", 0.0) for o, _, _ in runs]
        unmask_cpu = [o.server_cpu_seconds.get("unmasking", 0.0) for o, _, _ in runs]
        over_dropped = [u / p for u, (_, p, _) in zip(unmask_cpu, runs, strict=True) if p]
        over_all = [u / a for u, (_, _, a) in zip(unmask_cpu, runs, strict=True)]
        row[name]["dropout10"] = {
            "dropped": len(dropped), "survivors": survivors, "pair_masks_removed": pair,
            "self_masks_removed": survivors, "unmask_s": min(unmask),
            "unmask_cpu_s": min(unmask_cpu),
            "masked_input_stage_cpu_s": out.server_cpu_seconds.get("masked_input", 0.0),
            "prg_dropped_masks_s": min(p for _, p, _ in runs),
            "prg_all_masks_s": min(a for _, _, a in runs),
            "unmask_over_prg_dropped_each": over_dropped,
            "unmask_over_prg_dropped": statistics.median(over_dropped) if over_dropped else None,
            "unmask_over_prg_all": statistics.median(over_all)}
        got = row[name]["dropout10"]
        log(f"N={n} d={d} {name} 10% dropped: unmask {min(unmask) * 1e3:.1f} ms "
            f"({min(unmask_cpu) * 1e3:.1f} CPU), dropped masks "
            f"{got['prg_dropped_masks_s'] * 1e3:.1f} ms, all masks "
            f"{got['prg_all_masks_s'] * 1e3:.1f} ms, ratios "
            f"{' '.join(f'{r:.2f}' for r in over_dropped)}")
    del grid, one_thread, grids, app
    gc.collect()

    if flower:
        for name, shares in (("flower_shares3", 3), ("flower_shares_auto", auto_shares),
                             ("flower_shares_all", 1.0)):
            if name.removeprefix("flower_shares").lstrip("_") not in flower_shares:
                continue
            got_runs = flower_runs.get(name) or [flower_in_child(inputs, n, d, shares, limit,
                                                                 auto_t if name.endswith(
                                                                     "auto") else None)]
            done = [f for f in got_runs if "round_s" in f]
            best = min(done, key=lambda f: f["round_s"]) if done else got_runs[-1]
            row[name] = {"num_shares": n if shares == 1.0 else shares, **best}
            if name.endswith("auto"):
                row[name]["reconstruction_threshold"] = auto_t
                row[name]["neighbours"] = 2 * (auto_shares // 2)
            if done:
                row[name]["round_s_each"] = [f["round_s"] for f in done]
                row[name]["round_s_median"] = statistics.median(f["round_s"] for f in done)
            got = row[name]
            log(f"N={n} d={d} {name} " + (f"{got['round_s']:.3f} s, client "
                                          f"{got['client_cpu_s'] * 1e3:.1f} ms"
                                          if "round_s" in got else got.get("error",
                                                                           f"over {limit:g} s")))
    return row


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for suffix, label in (("_1t", "one_thread"), ("", "cores")):
        fedring = [f"fedring_{g}{suffix}" for g in GRAPHS]
        worst = max(((r[v]["overhead_over_prg"], r["N"], r["d"], v) for r in rows
                     for v in fedring if v in r
                     if r[v]["overhead_over_prg"] is not None and r["d"] >= 10**6),
                    default=None)
        if worst:  # client CPU time, on one thread and on the cores (threads cost some CPU)
            out[f"client_overhead_le_1.5x_prg_at_d_1M_{label}"] = {
                "worst": worst[0], "at": worst[1:], "met": worst[0] <= 1.5}
    ratios = [(r[v]["dropout10"]["unmask_over_prg_dropped"], r["N"], r["d"], v) for r in rows
              for v in ("fedring_auto", "fedring_full") if "dropout10" in r.get(v, {})
              if r[v]["dropout10"]["unmask_over_prg_dropped"] is not None]
    if ratios:
        worst_u = max(ratios)
        floor = max((r[v]["dropout10"]["unmask_over_prg_all"], r["N"], r["d"], v) for r in rows
                    for v in ("fedring_auto", "fedring_full") if "dropout10" in r.get(v, {}))
        out["unmask_le_1.5x_dropped_masks"] = {"worst": worst_u[0], "at": worst_u[1:],
                                               "met": worst_u[0] <= 1.5,
                                               "worst_over_all_masks": floor[0],
                                               "worst_over_all_masks_at": floor[1:]}
    for r in rows:
        if r["N"] == 100 and r["d"] >= 10**6 and "flower_shares3" in r and "fedring_k3" in r:
            f, k3 = r["flower_shares3"], r["fedring_k3"]
            flower_s = f.get("round_s", f.get("timed_out_after_s"))
            speedup = flower_s / k3["round_s"]
            out["k3_vs_flower_shares3_N100_d1M"] = {
                "flower_s": flower_s, "fedring_s": k3["round_s"], "speedup": speedup,
                "cpu_speedup": f["round_cpu_s"] / k3["round_cpu_s"] if "round_cpu_s" in f
                else None, "flower_timed_out": "round_s" not in f, "met": speedup >= 10}
        if r["N"] == 100 and r["d"] >= 10**6:
            out.update(malicious_targets(r))
        if r["N"] == 100 and r["d"] == 100_000 and "fedring_full" in r:
            full = r["fedring_full"]["round_s"]
            out["full_graph_N100_d100k_under_5s"] = {"round_s": full, "met": full < 5}
    return out


def malicious_targets(r: dict[str, Any]) -> dict[str, Any]:
    """At N = 100, d = 1M: each malicious variant's round against its semi-honest twin's
    (<= 1.3x), and k = 3 malicious against Flower's num_shares = 3 (>= 10x faster); with
    the clients' shared memo of verified signatures and with a memo per client."""
    out: dict[str, Any] = {}
    for suffix, label in (("_malicious", "shared_memo"), ("_malicious_per_client",
                                                          "per_client")):
        rows = {v: r[f"fedring_{v}{suffix}"] for v in VARIANTS
                if "round_over_semi_honest" in r.get(f"fedring_{v}{suffix}", {})}
        if rows:
            ratios = {v: got["round_over_semi_honest"] for v, got in rows.items()}
            out[f"malicious_le_1.3x_semi_honest_N100_d1M_{label}"] = {
                "ratios": ratios, "met": max(ratios.values()) <= 1.3,
                "round_cpu_ratios": {v: got["round_cpu_over_semi_honest"]
                                     for v, got in rows.items()}}
        for variant, flower_name in (("k3", "flower_shares3"), ("auto", "flower_shares_auto")):
            f, ours = r.get(flower_name), r.get(f"fedring_{variant}{suffix}")
            if f is None or ours is None:
                continue
            flower_s = f.get("round_s", f.get("timed_out_after_s"))
            if flower_s is None:  # Flower's round failed
                continue
            flower_med = f.get("round_s_median", flower_s)
            ours_med = statistics.median(ours["round_s_each"])
            out[f"{variant}_malicious_vs_{flower_name}_N100_d1M_{label}"] = {
                "flower_s": flower_s, "fedring_s": ours["round_s"],
                "speedup": flower_s / ours["round_s"],
                "flower_s_median": flower_med, "fedring_s_median": ours_med,
                "speedup_of_medians": flower_med / ours_med,
                "cpu_speedup": f["round_cpu_s"] / ours["round_cpu_s"] if "round_cpu_s" in f
                else None, "flower_timed_out": "round_s" not in f,
                "met": flower_med / ours_med >= 10}
    return out


def cifar_model_size() -> dict[str, int]:
    """What a secure round of the cifar10 scenario's model sums: the ResNet-style CNN's
    parameters and its floating-point batch-norm buffers (its integer batch counts stay
    on the clients)."""
    from simulations.models import build_model, count_parameters

    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=10)
    params = count_parameters(model)
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return {"params": params, "float_buffers": floats, "d": params + floats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny N and d, fedring only")
    parser.add_argument("--reps", type=int, default=0, help="repetitions of fedring rounds")
    parser.add_argument("--sizes", default="", help="e.g. '10x100000,100x1000000' (N x d)")
    parser.add_argument("--no-flower", action="store_true", help="leave Flower's SecAgg+ out")
    parser.add_argument("--flower-shares", default="3,all",
                        help="Flower's num_shares to run, any of '3', 'auto' (fedring's "
                             "automatic k, threshold its t) and 'all'")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="fedring variants to run: any of " + ",".join(VARIANTS))
    parser.add_argument("--security", default=",".join(SECURITY),
                        help="fedring's modes, alternated round by round: 'semi_honest', "
                             "'malicious' (with a shared and a per-client signature memo) "
                             "or both")
    parser.add_argument("--no-dropouts", action="store_true",
                        help="leave out the rounds with 10%% of the clients dropped")
    parser.add_argument("--cifar-model", action="store_true",
                        help="only N = 100 (quick: 4) at the cifar10 scenario's model size")
    parser.add_argument("--flower-limit", type=float, default=60.0,
                        help="seconds one Flower round may take before it is stopped")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    if args.quick:
        grid, reps, flower = [(4, 1000), (6, 10_000)], args.reps or 1, False
    else:
        grid = [(10, 100_000), (10, 1_000_000), (50, 100_000), (50, 1_000_000),
                (100, 100_000), (100, 1_000_000)]
        reps, flower = args.reps or 2, not args.no_flower
    if args.sizes:
        grid = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    cifar = cifar_model_size() if args.cifar_model else None
    if cifar is not None:
        grid = [(4 if args.quick else 100, cifar["d"])]
    variants = tuple(v for v in args.variants.split(",") if v)
    flower_shares = tuple(v for v in args.flower_shares.split(",") if v)
    security = tuple(v for v in args.security.split(",") if v)
    if not set(variants) <= set(VARIANTS) or not set(flower_shares) <= {"3", "auto", "all"} or \
            not set(security) <= set(SECURITY) or not security:
        parser.error(f"--variants takes {', '.join(VARIANTS)}; --flower-shares takes 3, auto, "
                     f"all; "
                     f"--security takes {', '.join(SECURITY)}")
    started = time.perf_counter()
    load_before = list(os.getloadavg())
    rows = []
    for n, d in grid:
        rows.append(measure(n, d, reps=reps, flower=flower,
                            limit=args.flower_limit,
                            log=lambda s: print(s, file=sys.stderr, flush=True),
                            variants=variants, dropouts=not args.no_dropouts,
                            flower_shares=flower_shares, security=security))
        if cifar is not None:
            rows[-1]["model"] = {"kind": "resnet (cifar10 scenario, 3x32x32, batch norm)",
                                 **cifar}
    import cryptography
    import flwr

    result = {"benchmark": "secagg", "quick": args.quick, "reps": reps, "variants": variants,
              "security": security,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "flwr": flwr.__version__,
                          "cryptography": cryptography.__version__,
                          "numpy": np.__version__},
              "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
              "wall_s": time.perf_counter() - started, "results": rows,
              "targets": targets(rows)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
