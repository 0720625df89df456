"""The secure round over Flower messages with synthetic clients (no training): exact sums."""

from __future__ import annotations

import numpy as np
import pytest
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs

from client.protocol.secagg import STAGE_NAMES, dropout_stage, dropping_partitions, stage_of
from client.secure_client import quantize_into
from privacy.secagg import quantize_weighted
from privacy.secagg.messages import read_header
from privacy.secagg.quantize import error_bound
from privacy.secagg.stages import MsgType
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid

N, DIM, ROUND = 8, 1000, 1


def run(inputs, settings, *, app=None, weight_by="examples", seed=0):
    arrays, config = empty_model()
    config["fedring.seed"] = seed
    grid = InProcessGrid(app or synthetic_app(inputs), len(inputs))
    session = SecAggSession(grid, settings, weight_by, 7, 5.0, 0.001)
    return session.run(list(inputs), ROUND, TrainStart(arrays, config, DIM))


def expected_sum(inputs, nodes, clip, cap, weight_by="examples"):
    total, weight = np.zeros(DIM), 0.0
    for node in nodes:
        delta, examples = inputs[node]
        w = 1.0 if weight_by == "uniform" else min(examples, cap)
        total += w * np.clip(delta.astype(np.float64), -clip, clip)
        weight += w
    return total, weight


def dropped_nodes(seed, fraction, stage):
    """Nodes (partition id + 1 on the in-process engine) that vanish in ROUND."""
    return {pid + 1: s for pid in range(N)
            if (s := dropout_stage(seed, ROUND, pid, fraction, stage, N)) is not None}


def seed_with_some_dropouts(fraction, stage, low=1, high=2):
    return next(s for s in range(200) if low <= len(dropped_nodes(s, fraction, stage)) <= high)


@pytest.mark.parametrize("weight_by", ["examples", "uniform"])
def test_all_present_gives_the_weighted_sum(weight_by):
    inputs = synthetic_inputs(N, DIM)
    settings = SecAggScenarioConfig(enabled=True, clip_range=1.0, max_weight=100.0)
    out = run(inputs, settings, weight_by=weight_by)
    assert out.status == "completed" and out.survivors == sorted(inputs)
    total, weight = expected_sum(inputs, inputs, 1.0, 100.0, weight_by)
    bound = error_bound(N, out.scale, "nearest") * 1.01
    assert abs(out.total_weight - weight) <= bound
    np.testing.assert_allclose(out.weighted_sum, total, rtol=0, atol=bound)
    assert all(not ids for ids in out.dropouts.values())


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_dropouts_at_each_stage_leave_the_survivors_sum(stage):
    seed = seed_with_some_dropouts(0.3, stage)
    drops = dropped_nodes(seed, 0.3, stage)
    inputs = synthetic_inputs(N, DIM, seed=seed)
    settings = SecAggScenarioConfig(enabled=True, dropout=0.3, dropout_stage=stage,
                                    clip_range=1.0, max_weight=100.0)
    out = run(inputs, settings, seed=seed)
    assert out.status == "completed", out.abort_reason
    assert out.dropouts[stage] == sorted(drops)
    assert all(not ids for name, ids in out.dropouts.items() if name != stage)
    counted = set(inputs) if stage == "unmasking" else set(inputs) - set(drops)
    assert out.survivors == sorted(counted)  # unmasking dropouts sent their masked input
    # in the merged flow a masked-input dropout sends its shares alone, then is asked nothing
    quiet = stage == "masked_input"
    assert all(quiet or "simulated dropout" in out.errors[node] for node in drops)
    total, weight = expected_sum(inputs, counted, 1.0, 100.0)
    bound = error_bound(len(counted), out.scale, "nearest") * 1.01
    assert abs(out.total_weight - weight) <= bound
    np.testing.assert_allclose(out.weighted_sum, total, rtol=0, atol=bound)
    fates = {int(r.client_id): r.fate for r in out.update_records()}
    assert {n for n, f in fates.items() if f == "accepted"} == counted


def test_random_stages_are_deterministic_per_seed_round_and_partition():
    a = [dropout_stage(3, 2, pid, 0.5, "random") for pid in range(200)]
    assert a == [dropout_stage(3, 2, pid, 0.5, "random") for pid in range(200)]
    assert a != [dropout_stage(3, 3, pid, 0.5, "random") for pid in range(200)]
    assert 60 < sum(s is not None for s in a) < 140
    assert {s for s in a if s is not None} == {stage_of(name) for name in STAGE_NAMES}


@pytest.mark.parametrize("stage", ["share_keys", "masked_input"])
def test_too_many_dropouts_abort_before_any_share_is_requested(stage):
    inputs = synthetic_inputs(N, DIM)
    seen: list[tuple[int, str, bytes]] = []
    seed = seed_with_some_dropouts(0.7, stage, low=5, high=N)
    settings = SecAggScenarioConfig(enabled=True, dropout=0.7, dropout_stage=stage)
    out = run(inputs, settings, app=synthetic_app(inputs, seen), seed=seed)
    assert out.status == "aborted" and out.weighted_sum is None
    assert "no share was requested" in out.abort_reason or "neighbours left" in \
        out.abort_reason
    kinds = {read_header(payload).kind for _, _, payload in seen if payload}
    assert MsgType.UNMASK_REQUEST not in kinds  # nothing was asked that could reveal an input
    assert all(r.fate != "accepted" for r in out.update_records())


def test_an_error_reply_is_a_dropout_and_a_garbled_one_is_rejected():
    inputs = synthetic_inputs(6, DIM)
    inner = synthetic_app(inputs)

    def app(msg, context):
        node = int(context.node_id)
        if node == 2 and msg.metadata.message_type == "query.secagg":
            raise RuntimeError("device went away")
        reply = inner(msg, context)
        if node == 3 and msg.metadata.message_type == "train.secagg":
            reply.content["secagg"]["msg"] = b"garbage"
        return reply

    settings = SecAggScenarioConfig(enabled=True, neighbors="full", threshold=3,
                                    clip_range=1.0)
    out = run(inputs, settings, app=app)
    assert out.status == "completed", out.abort_reason
    assert out.dropouts["share_keys"] == [2] and "device went away" in out.errors[2]
    assert 3 in out.rejected and out.survivors == [1, 4, 5, 6]
    total, _ = expected_sum(inputs, [1, 4, 5, 6], 1.0, 1000.0)
    np.testing.assert_allclose(out.weighted_sum, total, rtol=0,
                               atol=error_bound(4, out.scale, "nearest") * 1.01)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_chunked_quantizer_matches_the_reference_encoding(rounding):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_003) * 0.7).astype(np.float32)
    kwargs = {"clip_range": 1.0, "scale": 2.0**16, "max_weight": 50.0}
    out = np.empty(x.size + 1, np.uint32)
    quantize_into(x, 37.0, rounding=rounding, out=out, rng=np.random.default_rng(2), **kwargs)
    ref = quantize_weighted(x, 37.0, bits=32, rounding=rounding, rng=np.random.default_rng(2),
                            **kwargs)
    diff = np.abs(out.astype(np.int64) - ref.astype(np.int64))
    assert diff.max() <= 1  # the same rounding, up to float64 operation order
    assert diff.mean() < (1e-3 if rounding == "nearest" else 0.6)
    assert out[-1] == round(37.0 * 2.0**16)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_into(np.array([1.0, np.nan], np.float32), 1.0, rounding=rounding,
                      out=np.empty(3, np.uint32), **kwargs)


def test_a_fraction_of_the_federation_drops_in_every_round():
    counts = [len(dropping_partitions(7, rnd, 0.34, 3)) for rnd in range(1, 1001)]
    assert set(counts) == {1, 2}  # 1.02 per round: one, and a second 2% of the time
    assert 5 < counts.count(2) < 40
    assert all(len(dropping_partitions(7, rnd, 0.25, 20)) == 5 for rnd in range(1, 50))
    gone = dropping_partitions(7, 3, 0.25, 20)
    stages = {pid: dropout_stage(7, 3, pid, 0.25, "masked_input", 20) for pid in range(20)}
    assert {pid for pid, s in stages.items() if s is not None} == gone
    assert len({dropping_partitions(7, rnd, 0.25, 20) for rnd in range(1, 20)}) > 10
