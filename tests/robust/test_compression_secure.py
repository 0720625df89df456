"""Compression under secure aggregation and in async rounds, and the bytes each round sends.

Top-k on a shared pattern composes with SecAgg+: every client masks only the round's k
values plus its weight, and the server scatters the unmasked sum back into the model.
Masked words travel in the narrowest unsigned type that holds ``secagg.bits``, so QSGD's
smaller modulus shrinks the secure upload. Secure and async rounds record their bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

import server.compression
from aggregation.compression import CompressionConfig, RoundCodec
from client.compression import RESIDUAL
from client.protocol.compression import CompressionRequest
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_view
from client.protocol.secagg import SecAggKey, SecAggRecord
from client.secure_client import register_secagg, shared_request
from privacy.secagg import ProtocolError, run_secagg_round
from privacy.secagg.messages import (
    MsgType,
    decode_setup,
    decode_shares_and_input,
    read_header,
    wire_dtype,
)
from privacy.secagg.quantize import StatWords, error_bound, max_level, max_scale
from server.compression import SharedPattern
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from server.wire_bytes import ByteCountingGrid
from simulations.apps import build_task
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid

RANDK = ["compression.kind=topk", "compression.shared_pattern=true"]
SECURE = ["secagg.enabled=true"]
N, DIM = 6, 2000


@dataclass
class Fixed:
    """A local update that needs no training."""

    delta: np.ndarray
    metrics: MetricRecord


def synthetic_inputs(n: int, dim: int) -> dict[int, tuple[np.ndarray, int]]:
    """Node id -> (delta, num_examples)."""
    rng = np.random.default_rng(0)
    return {node: ((rng.standard_normal(dim) * 0.6).astype(np.float32),
                   int(rng.integers(5, 200))) for node in range(1, n + 1)}


def secure_app(update) -> ClientApp:
    """A ClientApp answering the secure-aggregation messages with ``update(context, msg)``."""
    app = ClientApp()
    register_secagg(app, lambda msg, context: update(context, msg))
    return app


def synthetic_app(inputs: dict[int, tuple[np.ndarray, int]]) -> ClientApp:
    def update(context: Context, msg: Message) -> Fixed:
        delta, count = inputs[int(context.node_id)]
        return Fixed(delta, MetricRecord({MetricKey.NUM_EXAMPLES: count}))

    return secure_app(update)


# --- masked words on the wire -----------------------------------------------------------

@pytest.mark.parametrize(("bits", "dtype"), [(8, np.uint8), (9, np.uint16), (16, np.uint16),
                                             (17, np.uint32), (32, np.uint32),
                                             (33, np.uint64), (64, np.uint64)])
def test_masked_words_are_the_narrowest_that_hold_bits(bits, dtype):
    assert wire_dtype(bits) == np.dtype(dtype)
    rng = np.random.default_rng(bits)
    inputs = [rng.integers(0, 1 << bits, 300, dtype=np.uint64).astype(
        np.uint32 if bits <= 32 else np.uint64) for _ in range(4)]
    seen: dict[int, np.ndarray] = {}

    def spy(stage, src, dst, payload):
        if src is not None and read_header(payload).kind is MsgType.SHARES_AND_INPUT:
            seen[src] = decode_shares_and_input(payload)[2].vector.copy()  # the merged flow
        return payload

    total, _ = run_secagg_round(inputs, k=3, t=2, bits=bits, intercept=spy)
    assert sorted(seen) == [1, 2, 3, 4]
    assert all(v.dtype == np.dtype(dtype) and v.size == 300 for v in seen.values())
    exact = [sum(int(x[i]) for x in inputs) % (1 << bits) for i in range(300)]
    assert total is not None and [int(v) for v in total] == exact


# --- one secure round with synthetic clients ------------------------------------------

def sparse_round(inputs, clip: float, contexts: dict[int, Context] | None = None,
                 sparse=None, error_feedback: bool = True):
    """A secure round of ``inputs`` with top-k on the shared pattern of run "r", round 1."""
    cfg = CompressionConfig(kind="topk", fraction=0.1, shared_pattern=True,
                            error_feedback=error_feedback)
    pattern = SharedPattern(cfg).for_round("r", 1, DIM) if sparse is None else sparse
    seen: list[tuple[int, str, bytes]] = []
    inner = synthetic_app(inputs)

    def app(msg: Message, context: Context) -> Message:
        if contexts is not None:
            contexts[int(context.node_id)] = context
        record = msg.content.get(SecAggRecord.PROTOCOL)
        seen.append((int(context.node_id), msg.metadata.message_type, record[SecAggKey.MSG]))
        return inner(msg, context)

    grid = ByteCountingGrid(InProcessGrid(app, len(inputs)))
    settings = SecAggScenarioConfig(enabled=True, clip_range=clip, max_weight=100.0)
    session = SecAggSession(grid, settings, "examples", 7, 5.0, 0.001)
    out = session.run(list(inputs), 1,
                      TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), DIM,
                                 sparse=pattern or None))
    return out, pattern, grid, seen


@pytest.mark.parametrize("clip", [4.0, 0.5])
def test_shared_pattern_round_sums_k_values_and_keeps_the_rest(clip):
    inputs = synthetic_inputs(N, DIM)
    assert max(np.abs(d).max() for d, _ in inputs.values()) < 4.0  # 4.0: nothing is clipped
    contexts: dict[int, Context] = {}
    out, pattern, grid, seen = sparse_round(inputs, clip, contexts)
    assert out.status == "completed" and out.survivors == sorted(inputs)
    idx = pattern.indices
    k = idx.size
    assert k == DIM // 10
    setups = [decode_setup(m)[1] for _, kind, m in seen if kind == "train.secagg"]
    stats = StatWords(k, max_level(clip, out.scale, 100.0), 100.0).words
    # k values, the weight and the stat words (values clipped, examples, loss)
    assert len(setups) == N and all(s.dim == k + 1 + stats for s in setups)
    # the exact weighted sum of the clipped pattern values, zero elsewhere
    w = {node: float(min(examples, 100)) for node, (_, examples) in inputs.items()}
    exact = np.zeros(DIM)
    for node, (delta, _) in inputs.items():
        exact[idx] += w[node] * np.clip(delta[idx].astype(np.float64), -clip, clip)
    bound = error_bound(N, out.scale, "nearest") * 1.01
    np.testing.assert_allclose(out.weighted_sum, exact, rtol=0, atol=bound)
    assert abs(out.total_weight - sum(w.values())) <= bound
    assert not out.weighted_sum[np.setdiff1d(np.arange(DIM), idx)].any()
    if clip == 4.0:  # the plain (no secagg) rand-k aggregate of the same replies
        codec = RoundCodec.for_round(CompressionConfig(kind="topk", fraction=0.1,
                                                       shared_pattern=True),
                                     DIM, run=server.compression.session_number("r"), rnd=1)
        plain = sum(w[n] * codec.decode(codec.encode(d)).astype(np.float64)
                    for n, (d, _) in inputs.items()) / sum(w.values())
        mean = out.weighted_sum / out.total_weight
        tol = bound * (1 + np.abs(plain).max()) / (sum(w.values()) - bound)
        np.testing.assert_allclose(mean, plain, rtol=0, atol=tol)
    # error feedback: each client keeps what it did not send (other coordinates, clipping)
    for node, (delta, _) in inputs.items():
        residual = np.asarray(contexts[node].state[RESIDUAL]["residual"].numpy())
        expected = delta.copy()
        expected[idx] -= np.clip(delta[idx], -clip, clip)
        np.testing.assert_array_equal(residual, expected)
    # the masked vectors carry k + 1 words instead of DIM + 1: 4 bytes each fewer
    dense, _, dense_grid, _ = sparse_round(inputs, clip, sparse=False)
    assert dense.status == "completed"
    assert dense_grid.up - grid.up == N * (DIM - k) * 4
    assert dense_grid.down == grid.down > 0


def test_a_bad_compression_request_in_setup_is_refused():
    good = CompressionRequest(CompressionConfig(kind="topk", shared_pattern=True), 3)
    assert shared_request(ConfigRecord({ConfigKey.COMPRESSION: good.to_json()})) == good
    assert shared_request(ConfigRecord()) is None
    qsgd = CompressionRequest(CompressionConfig(kind="qsgd"), 3).to_json()
    for raw, fragment in [("{", "bad 'fedring.compression'"), (qsgd, "kind 'qsgd'")]:
        with pytest.raises(ProtocolError, match=fragment):
            shared_request(ConfigRecord({ConfigKey.COMPRESSION: raw}))


def test_a_client_refusing_the_pattern_drops_out_and_the_round_goes_on():
    inputs = synthetic_inputs(N, DIM)
    inner = synthetic_app(inputs)

    def app(msg: Message, context: Context) -> Message:  # node 2 gets a malformed request
        record = msg.content.get(SecAggRecord.PROTOCOL)
        if int(context.node_id) == 2 and isinstance(record, ConfigRecord) \
                and ConfigKey.COMPRESSION in record:
            record[ConfigKey.COMPRESSION] = "not json"
        return inner(msg, context)

    cfg = CompressionConfig(kind="topk", fraction=0.1, shared_pattern=True)
    grid = InProcessGrid(app, N)
    settings = SecAggScenarioConfig(enabled=True, clip_range=4.0, max_weight=100.0)
    session = SecAggSession(grid, settings, "examples", 7, 5.0, 0.001)
    out = session.run(list(inputs), 1,
                      TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), DIM,
                                 sparse=SharedPattern(cfg).for_round("r", 1, DIM)))
    assert out.status == "completed" and 2 not in out.survivors
    assert "bad 'fedring.compression'" in out.errors[2]
    assert out.dropouts["advertise_keys"] == [2]


# --- whole runs on the in-process engine -------------------------------------------------

# whole partitions: the accuracy margins below were set on them
SMALL = ["federation.clients=8", "federation.rounds=3", "train.local_epochs=2",
         "data.partitioner=iid", "data.client_test_fraction=0"]


def test_secure_randk_and_qsgd_runs_learn_like_plain_ones_and_upload_less(run_inprocess, store,
                                                                          monkeypatch):
    # one run number for every run, so that the rand-k runs share each round's pattern
    monkeypatch.setattr(server.compression, "session_number", lambda run_id: 12345)
    randk = [*SMALL, *RANDK, "compression.fraction=0.3"]
    qsgd = [*SMALL, *SECURE, "compression.kind=qsgd", "compression.bits=8"]
    runs, models = {}, {}
    for name, overrides in {"plain": randk, "secure": [*randk, *SECURE],
                            "dense": [*SMALL, *SECURE], "qsgd": qsgd}.items():
        models[name] = []
        runs[name] = run_inprocess(load_scenario("default", overrides), models=models[name])
        assert runs[name]["status"] == "completed" and runs[name]["versions"] == 3
    config = load_scenario("default", [*randk, *SECURE])
    dim = build_task(config).initial_params()[1].dim
    k = CompressionConfig(**config["compression"]).k_for(dim)
    # round 1 (same model, clients, training and pattern): the same aggregate within the
    # fixed-point bound of the secure sum; rand-k leaves 70% of the coordinates unchanged
    plain_step = models["plain"][1].astype(np.float64) - models["plain"][0]
    secure_step = models["secure"][1].astype(np.float64) - models["secure"][0]
    assert np.count_nonzero(plain_step) <= k and np.count_nonzero(secure_step) <= k
    weight = sum(u.num_examples for _, u in store.updates(runs["plain"]["run_id"], round=1)
                 if u.fate == "accepted")
    settings = SecAggScenarioConfig.from_dict(config["secagg"])
    e = error_bound(8, settings.scale_for(8, "examples"), "nearest")
    tol = e * (1 + np.abs(plain_step).max()) / (weight - e) + 4e-7  # + float32 rounding
    np.testing.assert_allclose(secure_step, plain_step, rtol=0, atol=tol)
    accuracy = {name: r["final_accuracy"] for name, r in runs.items()}
    assert abs(accuracy["secure"] - accuracy["plain"]) <= 0.03 and accuracy["secure"] > 0.6
    assert accuracy["qsgd"] > accuracy["dense"] - 0.03
    # bytes of every secure round: rand-k masks k + 1 words per client instead of dim + 1;
    # QSGD's modulus fits 16-bit words instead of 32-bit ones
    assert wire_dtype(runs_bits := load_scenario("default", qsgd)["secagg"]["bits"]) \
        .itemsize == 2 and runs_bits < 16
    rounds = {name: store.rounds(r["run_id"])[1:] for name, r in runs.items()}
    for name in ("secure", "dense", "qsgd"):
        assert all(r.metrics["bytes_up"] > 0 and r.metrics["bytes_down"] > 0
                   for r in rounds[name])
        assert runs[name]["bytes_up"] == sum(r.metrics["bytes_up"] for r in rounds[name])
    for sparse, dense, quantized in zip(rounds["secure"], rounds["dense"], rounds["qsgd"],
                                        strict=True):
        assert dense.metrics["bytes_up"] - sparse.metrics["bytes_up"] == 8 * (dim - k) * 4
        assert dense.metrics["bytes_up"] - quantized.metrics["bytes_up"] == 8 * (
            words(dense.metrics, dim, 32) * 4 - words(quantized.metrics, dim, runs_bits) * 2)
        assert dense.metrics["bytes_down"] == sparse.metrics["bytes_down"] == \
            quantized.metrics["bytes_down"]
    assert runs["qsgd"]["bytes_up"] < 0.55 * runs["dense"]["bytes_up"]


def words(metrics: dict[str, float], dim: int, bits: int, n: int = 8) -> int:
    """A dense secure client's words: the coordinates, the weight and the stat words, at
    the round's clip range."""
    r = metrics["secagg_clip_range"]
    return dim + 1 + StatWords(dim, max_level(r, max_scale(n, bits, r, 1000.0), 1000.0),
                               1000.0).words


ASYNC = ["federation.clients=8", "federation.rounds=4", "train.local_epochs=1",
         "data.partitioner=iid", "driver.buffer_size=3", "data.client_test_fraction=0"]


def test_async_rounds_compress_and_record_their_bytes(run_inprocess, store):
    runs, models = {}, []
    for name, overrides in {"fedbuff": ["driver.kind=fedbuff"],
                            "fedbuff_topk": ["driver.kind=fedbuff", "compression.kind=topk"],
                            "fedasync_qsgd": ["driver.kind=fedasync", "compression.kind=qsgd"],
                            "fedbuff_randk": ["driver.kind=fedbuff", *RANDK]}.items():
        models.clear()
        runs[name] = run_inprocess(load_scenario("default", [*ASYNC, *overrides]),
                                   simulated=True, models=models)
        summary = runs[name]
        assert summary["status"] == "completed" and summary["versions"] == 4, name
        rounds = store.rounds(summary["run_id"])
        applied = [r for r in rounds[1:] if r.status == "completed"]
        # each round counts the replies it processed, and what was pushed since the last
        assert len(applied) == 4 and all(r.metrics["bytes_up"] > 0 for r in applied)
        assert applied[0].metrics["bytes_down"] > 0
        for key in ("bytes_up", "bytes_down"):  # every byte in exactly one round
            assert summary[key] == sum(r.metrics[key] for r in rounds[1:])
        rejected = [u.reason for _, u in store.updates(summary["run_id"])
                    if u.fate == "rejected"]
        assert rejected == [], rejected
    # rand-k: each update was decoded on the pattern of the round its task was sent in
    # (its base version + 1), so an aggregate moves only those patterns' coordinates
    config = load_scenario("default", [*ASYNC, "driver.kind=fedbuff", *RANDK])
    codecs = server.compression.ReplyCompression(CompressionConfig(**config["compression"]))
    run_id = runs["fedbuff_randk"]["run_id"]
    for rnd in range(1, 5):
        bases = {u.base_version for _, u in store.updates(run_id, round=rnd)
                 if u.fate == "accepted"}
        covered = np.zeros(models[rnd].size, bool)
        for base in bases:
            covered[codecs.codec(run_id, base + 1, models[rnd].size).pattern] = True
        moved = models[rnd] != models[rnd - 1]
        assert moved.any() and not (moved & ~covered).any()
    per_update = {name: r["bytes_up"] / sum(
        u.fate != "dropped" for _, u in store.updates(r["run_id"])) for name, r in runs.items()}
    assert per_update["fedbuff"] / per_update["fedbuff_topk"] > 4.5
    assert per_update["fedbuff"] / per_update["fedbuff_randk"] > 9
    assert runs["fedbuff_topk"]["final_accuracy"] > 0.6


def test_secure_fedbuff_sums_the_shared_pattern_of_each_buffer(run_inprocess, store):
    """Clients hold a known delta (step * node everywhere); each buffer's secure sum is the
    weighted mean of the buffer's deltas on that buffer's pattern, zero elsewhere."""
    step = 1e-3

    def update(context: Context, msg: Message) -> Fixed:
        node = int(context.node_config["partition-id"]) + 1
        dim = sum(npy_view(a).size for a in msg.content["arrays"].values())
        return Fixed(np.full(dim, step * node, np.float32),
                     MetricRecord({MetricKey.NUM_EXAMPLES: 10 + node}))

    common = ["federation.clients=6", "federation.rounds=3", "driver.kind=fedbuff",
              "driver.buffer_size=3", "data.partitioner=iid", 'secagg.neighbors="full"',
              *SECURE]
    runs, models = {}, {}
    for name, extra in {"dense": [], "randk": [*RANDK, "compression.error_feedback=false"]
                        }.items():
        models[name] = []
        runs[name] = run_inprocess(load_scenario("default", [*common, *extra]),
                                   secure_app(update), simulated=True, models=models[name])
        assert runs[name]["versions"] == 3
    cfg = load_scenario("default", [*common, *RANDK])
    dim = build_task(cfg).initial_params()[1].dim
    compression = CompressionConfig(**cfg["compression"])
    k = compression.k_for(dim)
    settings = SecAggScenarioConfig.from_dict(cfg["secagg"])
    run_id = runs["randk"]["run_id"]
    sessions = {x["round"]: x for x in store.secagg_rounds(run_id)}
    for rnd in range(1, 4):
        nodes = [int(c) for c in sessions[rnd]["survivors"]]
        assert sessions[rnd]["status"] == "completed" and len(nodes) == 3
        weight = sum(10 + n for n in nodes)
        mean = sum((10 + n) * step * n for n in nodes) / weight
        pattern = SharedPattern(compression).for_round(run_id, rnd, dim).indices
        expected = np.zeros(dim)
        expected[pattern] = mean  # this buffer's pattern; the rest of the model unchanged
        e = error_bound(3, settings.scale_for(3, "examples"), "nearest")
        tol = e * (1 + mean) / (weight - e) + 1e-6  # + float32 rounding of the model
        got = models["randk"][rnd].astype(np.float64) - models["randk"][rnd - 1]
        np.testing.assert_allclose(got, expected, rtol=0, atol=tol)
    up = {name: sum(r.metrics["bytes_up"] for r in store.rounds(r_["run_id"])[1:])
          for name, r_ in runs.items()}
    assert up["dense"] - up["randk"] == 3 * 3 * (dim - k) * 4  # 3 buffers of 3 clients
