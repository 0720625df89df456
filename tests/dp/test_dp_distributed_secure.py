"""Distributed DP (and central DP) under secure aggregation, on the real secure round path.

The clients are synthetic (fixed deltas, no training) where the test measures noise, and
the real ClientApp where it checks a whole run; all go through Flower messages, the
SecAgg+ state machines and the server's decoding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from client import secure_client as sc
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_view
from client.protocol.secagg import SecAggAction, SecAggKey, SecAggRecord, dropout_stage
from client.secure_client import register_secagg
from privacy.dp import DistributedDPPlan, DPConfig, distributed_decode, wrap_to_signed
from privacy.secagg.messages import read_header
from privacy.secagg.stages import MsgType
from server.config import FederationConfig
from server.dp import DPController, dp_controller
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.apps import build_task
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid

N, DIM, BITS, CLIP, Z = 8, 20_000, 20, 0.5, 1.0


@dataclass
class Fixed:
    delta: np.ndarray
    metrics: MetricRecord


def fixed_app(deltas: dict[int, np.ndarray], seen: dict | None = None) -> ClientApp:
    """Secure-aggregation clients answering with fixed deltas; ``seen`` collects each
    client's SETUP settings, its SecAgg input words and the server's message kinds."""
    app = ClientApp()
    register_secagg(app, lambda msg, ctx: Fixed(deltas[int(ctx.node_id)],
                                                 MetricRecord({MetricKey.NUM_EXAMPLES: 10})))
    if seen is None:
        return app

    def recording(msg: Message, context: Context) -> Message:
        record = msg.content.get(SecAggRecord.PROTOCOL)
        if isinstance(record, ConfigRecord):
            seen.setdefault("kinds", set()).add(read_header(record[SecAggKey.MSG]).kind)
        reply = app(msg, context)
        if msg.metadata.message_type == f"train.{SecAggAction.SECAGG}":
            seen.setdefault("setup", []).append(dict(record))
            words = npy_view(context.state[sc.INPUT]["input"])
            seen.setdefault("inputs", {})[int(context.node_id)] = np.array(words)
        return reply

    return recording  # type: ignore[return-value]


def distributed_controller(mechanism: str, budget: float | None = None) -> DPController:
    dp = DPController(DPConfig(mode="distributed", clip=CLIP, noise_multiplier=Z,
                               mechanism=mechanism, epsilon_budget=budget),
                      clients=N, clients_per_round=N, sampling="fixed")
    dp.plan_distributed(dim=DIM, bits=BITS, max_clients=N)
    return dp


def run_round(deltas, dp, settings=None, seen=None, seed=0):
    settings = settings or SecAggScenarioConfig(enabled=True, bits=BITS)
    grid = InProcessGrid(fixed_app(deltas, seen), len(deltas))
    session = SecAggSession(grid, settings, "uniform", 11, 10.0, 0.001, dp)
    return session.run(list(deltas), 1,
                       TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: seed}), DIM))


def clipped(delta: np.ndarray) -> np.ndarray:
    x = delta.astype(np.float64)
    return x * min(1.0, CLIP / np.linalg.norm(x))


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_secure_sum_has_the_target_noise_and_never_wraps(mechanism):
    dp = distributed_controller(mechanism)
    rng = np.random.default_rng(0)
    same = (rng.standard_normal(DIM) * 0.1).astype(np.float32)  # norm ~14, clipped to 0.5
    deltas = {node: same for node in range(1, N + 1)}  # aligned: the worst case for headroom
    seen: dict = {}
    out = run_round(deltas, dp, seen=seen)
    assert out.status == "completed", out.abort_reason
    assert out.survivors == list(range(1, N + 1)) and out.total_weight == N
    # The noise of the decoded sum is the planned Gaussian-equivalent one: z * C, up to the
    # rounding inflation of the sensitivity (tiny at these scales).
    plan = dp.plan
    assert plan.norm_inflation < 1.001
    assert plan.sum_noise_std == pytest.approx(Z * CLIP * plan.norm_inflation, rel=1e-9)
    residual = out.weighted_sum - N * clipped(same)
    assert residual.std() == pytest.approx(Z * CLIP, rel=0.03)  # 20000 values: ~0.5 % error
    assert abs(residual.mean()) < 6 * Z * CLIP / math.sqrt(DIM)  # fresh noise: 6 errors
    assert out.noise_multiplier == pytest.approx(plan.effective_noise_multiplier)
    # Every client got the same round plan; the exact integer sum of what they masked never
    # leaves the signed range of [secagg] bits, and the secure sum decodes exactly to it.
    [raw] = {s[SecAggKey.DP_PLAN] for s in seen["setup"]}
    values = json.loads(raw)
    seed = values.pop(SecAggKey.ROTATION_SEED)
    round_plan = DistributedDPPlan.from_dict(values)
    assert round_plan.bits == BITS and round_plan.local_std == pytest.approx(
        Z * plan.norm_bound / math.sqrt(N))
    exact = np.sum([wrap_to_signed(w, BITS) for w in seen["inputs"].values()], axis=0)
    half = 2 ** (BITS - 1)
    assert np.abs(exact).max() < half
    assert np.abs(exact).max() > half / plan.k_stddevs  # the range is used, not wasted
    np.testing.assert_array_equal(
        distributed_decode(np.mod(exact, 2**BITS), round_plan, seed),
        out.weighted_sum.astype(np.float32))


def test_each_client_sends_noise_no_one_can_replay():
    dp = distributed_controller("discrete_gaussian")
    plan = dp.plan.for_clients(N)
    delta = np.zeros(DIM, np.float32)
    a = sc.encode_distributed(delta, plan, rotation_seed=5)
    b = sc.encode_distributed(delta, plan, rotation_seed=5)
    assert a.dtype == np.uint32 and a.size == plan.padded_dim
    signed = wrap_to_signed(a, BITS)
    assert not np.array_equal(a, b)  # same input and seeds: fresh noise each time
    assert signed.std() == pytest.approx(plan.local_std, rel=0.03)


def seed_with_dropouts(fraction: float, stage: str, count: int) -> int:
    return next(s for s in range(500)
                if sum(dropout_stage(s, 1, pid, fraction, stage, N) is not None
                       for pid in range(N)) == count)


def test_a_round_with_dropouts_is_charged_the_noise_it_holds():
    dp = distributed_controller("discrete_gaussian")
    seed = seed_with_dropouts(0.3, "masked_input", 2)
    settings = SecAggScenarioConfig(enabled=True, bits=BITS, dropout=0.3,
                                    dropout_stage="masked_input")
    deltas = {node: np.zeros(DIM, np.float32) for node in range(1, N + 1)}
    out = run_round(deltas, dp, settings, seed=seed)
    assert out.status == "completed" and len(out.survivors) == N - 2
    assert out.noise_multiplier == pytest.approx(Z * math.sqrt((N - 2) / N), rel=1e-6)
    assert out.weighted_sum.std() == pytest.approx(Z * CLIP * math.sqrt((N - 2) / N), rel=0.03)


def test_dropouts_that_would_break_the_budget_abort_before_any_unmasking():
    probe = distributed_controller("discrete_gaussian")
    budgeted = probe.accountants["epsilon_replace_one"]  # dp.budget_relation's default
    full = budgeted.epsilon_after(1, probe.plan.noise_multiplier_with(N))
    short = budgeted.epsilon_after(1, probe.plan.noise_multiplier_with(N - 2))
    assert short > full
    dp = distributed_controller("discrete_gaussian", budget=(full + short) / 2)
    assert dp.next_round_exceeds_budget() is None  # a full round fits
    seed = seed_with_dropouts(0.3, "masked_input", 2)
    settings = SecAggScenarioConfig(enabled=True, bits=BITS, dropout=0.3,
                                    dropout_stage="masked_input")
    seen: dict = {}
    deltas = {node: np.zeros(DIM, np.float32) for node in range(1, N + 1)}
    out = run_round(deltas, dp, settings, seen=seen, seed=seed)
    assert out.status == "aborted" and out.weighted_sum is None
    assert "dp.epsilon_budget" in out.abort_reason and "no share was requested" in \
        out.abort_reason
    assert MsgType.UNMASK_REQUEST not in seen["kinds"]
    assert all(r.fate != "accepted" for r in out.update_records())


# ---- whole runs: configuration, accounting, the budget stop, central DP with secagg

SECURE = ["federation.clients=5", "train.local_epochs=1", "train.batch_size=64",
          "secagg.enabled=true",
          "aggregation.weight_by=uniform", "dp.clip=0.5", "dp.noise_multiplier=1.0"]


@pytest.mark.parametrize("overrides, match", [
    (["dp.mode=distributed", "secagg.enabled=false"], "secagg.enabled = true"),
    (["dp.mode=distributed", "aggregation.weight_by=examples"], "aggregation.weight_by"),
    (["dp.mode=distributed", "dp.clip=adaptive"], "numeric dp.clip"),
    (["dp.mode=distributed", "secagg.bits=60"], "secagg.bits <= 53"),
    (["dp.mode=central", "dp.clip=adaptive"], "cannot see under secure aggregation"),
    (["dp.mode=local"], "dp.mode = 'distributed'"),
])
def test_impossible_combinations_fail_at_configuration(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SECURE, *overrides])


def test_a_noisy_sum_that_could_wrap_fails_at_start_naming_secagg_bits(run_inprocess):
    cfg = load_scenario("default", [*SECURE, "dp.mode=distributed", "secagg.bits=8"])
    with pytest.raises(ValueError, match=r"secagg\.bits = 8 .*raise bits to at least \d+"):
        run_inprocess(cfg)


def test_distributed_run_accounts_each_round_and_stops_at_the_budget(run_inprocess, store):
    base = load_scenario("default", [*SECURE, "dp.mode=distributed", "federation.rounds=2"])
    dim = build_task(base).initial_params()[0].size
    probe = dp_controller(DPConfig.from_dict(base["dp"]), FederationConfig(**base["federation"]))
    plan = probe.plan_distributed(dim=dim, bits=base["secagg"]["bits"], max_clients=5)
    # the budget caps the replace-one figure (dp.budget_relation's default)
    budgeted = probe.accountants["epsilon_replace_one"]
    eps = [budgeted.epsilon_after(r, plan.effective_noise_multiplier) for r in (1, 2)]
    cfg = load_scenario("default", [*SECURE, "dp.mode=distributed", "federation.rounds=2",
                                    f"dp.epsilon_budget={(eps[0] + eps[1]) / 2}"])
    summary = run_inprocess(cfg)
    assert summary["status"] == "stopped" and summary["rounds"] == 1
    assert summary["versions"] == 1 and summary["dp_mode"] == "distributed"
    assert "dp.epsilon_budget" in summary["stop_reason"]
    assert summary["epsilon_replace_one"] == pytest.approx(eps[0], rel=1e-9)
    [row] = store.privacy_ledger(summary["run_id"])
    assert row["mode"] == "distributed"
    assert row["epsilon_replace_one"] == pytest.approx(eps[0], rel=1e-9)
    assert row["noise_multiplier"] == pytest.approx(plan.effective_noise_multiplier)
    assert [r["status"] for r in store.secagg_rounds(summary["run_id"])] == ["completed"]
    ckpt = store.load_checkpoint(summary["run_id"])
    for figure in ckpt.state["dp"]["figures"].values():
        assert figure["history"] == [[plan.effective_noise_multiplier, 1]]


def test_central_dp_with_secagg_clips_on_the_client_and_noises_the_sum(run_inprocess, store):
    cfg = load_scenario("default", ["federation.clients=4", "federation.rounds=1",
                                    "secagg.enabled=true", "aggregation.weight_by=uniform",
                                    "dp.mode=central", "dp.clip=0.5", "dp.noise_multiplier=0.5"])
    dim = build_task(cfg).initial_params()[0].size
    big = (np.random.default_rng(1).standard_normal(dim) * 3).astype(np.float32)  # norm ~300
    deltas = {1: big, **{node: np.zeros(dim, np.float32) for node in (2, 3, 4)}}
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, app=fixed_app(deltas), models=models)
    assert summary["status"] == "completed" and summary["dp_mode"] == "central"
    change = models[1].astype(np.float64) - models[0]
    residual = change - clipped(big) / 4  # the client clipped to 0.5; mean over 4 clients
    assert residual.std() == pytest.approx(0.5 * 0.5 / 4, rel=0.065)  # z C / clients, 6 errors
    [row] = store.privacy_ledger(summary["run_id"])
    assert row["mode"] == "central" and row["epsilon"] == pytest.approx(summary["epsilon"])
