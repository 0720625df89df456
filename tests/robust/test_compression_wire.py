"""Compressed uploads on the wire: round codecs, the client stage with error feedback,
hostile payloads rejected with a reason, and [compression] refused where it cannot work."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from aggregation.compression import CompressionConfig, RoundCodec, shared_pattern
from client.compression import RESIDUAL, compress, load_residual, reply_record
from client.protocol.compression import CompressionRequest
from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey
from client.protocol.npy import npy_array, npy_view
from privacy.secagg import max_scale
from privacy.secagg.quantize import max_level
from server.compression import ReplyCompression
from server.replies import decode_compressed
from simulations.config import load_scenario

DIM = 1000


def codec(**settings) -> RoundCodec:
    return RoundCodec.for_round(CompressionConfig(**settings), DIM, run=7, rnd=3)


def delta(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


def record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: npy_array(a) for name, a in arrays.items()})


def views(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: npy_view(rec[name]) for name in rec}


# --- codecs ---------------------------------------------------------------------------

@pytest.mark.parametrize(("bits", "bucket"), [(4, 128), (2, 0), (8, 512)])
def test_qsgd_round_trip_is_within_one_level(bits, bucket):
    v = delta(bits)
    c = codec(kind="qsgd", bits=bits, bucket_size=bucket)
    arrays = c.encode(v, seed=1)
    size = bucket or DIM
    buckets = math.ceil(DIM / size)
    assert arrays["norms"].dtype == np.float32 and arrays["norms"].shape == (buckets,)
    assert arrays["codes"].dtype == np.uint8
    assert arrays["codes"].shape == (math.ceil(DIM * (bits + 1) / 8),)
    out = c.decode(arrays)
    assert out.dtype == np.float32 and out.shape == (DIM,)
    padded = np.zeros(buckets * size)
    padded[:DIM] = v
    norms = np.linalg.norm(padded.reshape(buckets, size), axis=1)
    np.testing.assert_allclose(arrays["norms"], norms, rtol=1e-6)
    step = np.repeat(norms / (2**bits - 1), size)[:DIM]  # one quantization level
    assert np.all(np.abs(out - v) <= step * (1 + 1e-5))
    assert np.all((out == 0) | (np.sign(out) == np.sign(v)))


def test_qsgd_codec_is_unbiased():
    v = delta(1)[:64].copy()
    c = RoundCodec(CompressionConfig(kind="qsgd", bits=2, bucket_size=16), 64)
    rng = np.random.default_rng(2)
    mean = np.mean([c.decode(c.encode(v, rng)) for _ in range(4000)], axis=0)
    step = np.repeat(np.linalg.norm(v.reshape(4, 16), axis=1) / 3, 16)
    assert np.all(np.abs(mean - v) <= 5 * step / 2 / math.sqrt(4000) + 1e-6)


@pytest.mark.parametrize("settings", [{"fraction": 0.05}, {"k": 17}])
def test_topk_keeps_the_largest_coordinates(settings):
    v = delta(3)
    c = codec(kind="topk", **settings)
    k = c.config.k_for(DIM)
    arrays = c.encode(v)
    assert arrays["indices"].dtype == np.uint32 and arrays["values"].dtype == np.float32
    out = c.decode(arrays)
    kept = np.flatnonzero(out)
    assert kept.tolist() == sorted(np.argsort(-np.abs(v))[:k].tolist())
    np.testing.assert_array_equal(out[kept], v[kept])


def test_shared_pattern_is_the_same_for_a_round_and_sends_values_only():
    v = delta(4)
    c = codec(kind="topk", fraction=0.1, shared_pattern=True)
    arrays = c.encode(v)
    assert list(arrays) == ["values"] and arrays["values"].shape == (100,)
    out = c.decode(arrays)
    np.testing.assert_array_equal(np.flatnonzero(out), c.pattern)
    np.testing.assert_array_equal(out[c.pattern], v[c.pattern])
    np.testing.assert_array_equal(c.pattern, shared_pattern(7, 3, DIM, 100))
    assert not np.array_equal(c.pattern, shared_pattern(7, 4, DIM, 100))
    assert not np.array_equal(c.pattern, shared_pattern(8, 3, DIM, 100))


def test_encoded_bytes_shrink_by_the_expected_factor():
    dense = DIM * 4
    qsgd = codec(kind="qsgd", bits=4, bucket_size=500).encode(delta())
    assert sum(a.nbytes for a in qsgd.values()) == math.ceil(DIM * 5 / 8) + 2 * 4
    topk = codec(kind="topk", fraction=0.1).encode(delta())
    assert sum(a.nbytes for a in topk.values()) == dense / 5  # 8 bytes per kept coordinate
    randk = codec(kind="topk", fraction=0.1, shared_pattern=True).encode(delta())
    assert sum(a.nbytes for a in randk.values()) == dense / 10


# --- the client stage and error feedback ----------------------------------------------

def test_error_feedback_residual_lives_in_the_node_state():
    request = CompressionRequest(CompressionConfig(kind="topk", k=20), run=11)
    state = RecordDict()
    rng = np.random.default_rng(0)
    deltas = [delta(s) for s in range(6)]
    sent_total = np.zeros(DIM)
    for rnd, d in enumerate(deltas, start=1):
        before = load_residual(state, 11, DIM)
        carried = np.zeros(DIM, np.float32) if before is None else before.copy()
        sent = request.codec(DIM, rnd).decode(views(compress(d, request, rnd, state, rng)))
        residual = load_residual(state, 11, DIM)
        assert residual is not None and np.count_nonzero(sent) == 20
        # what was sent plus what is kept is exactly this delta plus the carried residual
        np.testing.assert_array_equal(sent + residual, d + carried)
        sent_total += sent
        np.testing.assert_allclose(sent_total + residual, np.sum(deltas[:rnd], axis=0),
                                   rtol=1e-5, atol=1e-5)
    # another run starts from no residual: it sends the top-k of its own delta
    other = CompressionRequest(request.config, run=12)
    assert load_residual(state, 12, DIM) is None
    fresh = other.codec(DIM, 1).decode(views(compress(deltas[0], other, 1, state, rng)))
    np.testing.assert_array_equal(fresh, codec(kind="topk", k=20).decode(
        codec(kind="topk", k=20).encode(deltas[0])))


def test_qsgd_with_error_feedback_keeps_the_rounding_error():
    request = CompressionRequest(CompressionConfig(kind="qsgd", bits=2, error_feedback=True),
                                 run=1)
    state = RecordDict()
    d = delta(5)
    sent = request.codec(DIM, 1).decode(views(compress(d, request, 1, state,
                                                       np.random.default_rng(0))))
    np.testing.assert_array_equal(load_residual(state, 1, DIM), d - sent)
    plain = CompressionRequest(CompressionConfig(kind="qsgd", bits=2), run=1)
    assert plain.config.error_feedback is False
    compress(d, plain, 1, fresh := RecordDict(), np.random.default_rng(0))
    assert RESIDUAL not in fresh


def test_reply_record_follows_the_request():
    d = delta()
    plain = ConfigRecord({"server-round": 1})
    assert reply_record(plain, d, RecordDict(), 0)[0] == "delta"
    asked = ConfigRecord({"server-round": 1, ConfigKey.COMPRESSION: ReplyCompression(
        CompressionConfig(kind="qsgd")).request("run-a")})
    name, rec = reply_record(asked, d, RecordDict(), 0)
    assert name == "compressed" and sorted(rec.keys()) == ["codes", "norms"]
    # the rounding is seeded by (seed, round, partition): reproducible, differs per client
    again = reply_record(asked, d, RecordDict(), 0)[1]
    other = reply_record(asked, d, RecordDict(), 1)[1]
    assert again["codes"].data == rec["codes"].data != other["codes"].data
    for bad in ("not json", '{"kind": "qsgd"}', '{"kind": "zip", "run": 1}'):
        with pytest.raises(WireError, match=ConfigKey.COMPRESSION):
            reply_record(ConfigRecord({ConfigKey.COMPRESSION: bad}), d, RecordDict(), 0)


# --- hostile payloads -----------------------------------------------------------------

def _topk(mutate) -> dict[str, np.ndarray]:
    arrays = {k: v.copy() for k, v in codec(kind="topk", k=10).encode(delta()).items()}
    return mutate(arrays) or arrays


def _qsgd(mutate) -> dict[str, np.ndarray]:
    arrays = {k: v.copy() for k, v in codec(kind="qsgd", bits=4).encode(delta()).items()}
    return mutate(arrays) or arrays


def _set(arrays, name, index, value):
    arrays[name][index] = value


HOSTILE = {
    "index out of range": (_topk(lambda a: _set(a, "indices", -1, DIM)), "< 1000"),
    "repeated index": (_topk(lambda a: _set(a, "indices", 1, a["indices"][0])),
                       "strictly increasing"),
    "too few values": (_topk(lambda a: {**a, "values": a["values"][:-1]}), "shape"),
    "int64 indices": (_topk(lambda a: {**a, "indices": a["indices"].astype(np.int64)}),
                      "dtype int64"),
    "NaN value": (_topk(lambda a: _set(a, "values", 2, np.nan)), "NaN/Inf"),
    "level out of range": (_qsgd(lambda a: _set(a, "codes", slice(None), 0xFF)),
                           "level out of range"),
    "short codes": (_qsgd(lambda a: {**a, "codes": a["codes"][:-1]}), "shape"),
    "NaN norm": (_qsgd(lambda a: _set(a, "norms", 0, np.nan)), "NaN/Inf"),
    "negative norm": (_qsgd(lambda a: _set(a, "norms", 1, -1.0)), "negative"),
    "float64 norms": (_qsgd(lambda a: {**a, "norms": a["norms"].astype(np.float64)}),
                      "dtype float64"),
    "extra array": (_qsgd(lambda a: {**a, "delta": np.zeros(DIM, np.float32)}), "arrays"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_payload_is_rejected_with_a_reason(case):
    arrays, fragment = HOSTILE[case]
    kind = "qsgd" if "codes" in arrays else "topk"
    c = codec(kind="qsgd", bits=4) if kind == "qsgd" else codec(kind="topk", k=10)
    with pytest.raises(WireError, match="compressed") as err:
        decode_compressed(record(arrays), c)
    assert fragment in str(err.value)


def test_compressed_reply_when_none_was_asked_or_not_an_array_record():
    arrays = codec(kind="topk", k=10).encode(delta())
    with pytest.raises(WireError, match="does not compress"):
        decode_compressed(record(arrays), None)
    with pytest.raises(WireError, match="expected an ArrayRecord"):
        decode_compressed(ConfigRecord({"x": 1}), codec(kind="topk", k=10))


# --- configuration --------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "fragment"), [
    (["compression.kind=zip"], "compression.kind 'zip' is unknown"),
    (["compression.kind=qsgd", "compression.bits=0"], "compression.bits must be in [1, 16]"),
    (["compression.kind=topk", "compression.fraction=1.5"], "compression.fraction"),
    (["compression.kind=topk", "compression.k=5", "compression.fraction=0.1"], "not both"),
    (["compression.kind=qsgd", "compression.shared_pattern=true"], "applies to kind = 'topk'"),
    (["compression.kind=qsgd", "compression.bucket_size=-1"], "compression.bucket_size"),
    (["compression.kind=topk", "compression.error_feedback=1"], "compression.error_feedback"),
    (["compression.kind=qsgd", "driver.kind=cross_silo"], "compression does not apply"),
    (["compression.kind=topk", "compression.shared_pattern=true", "driver.late_policy=carry"],
     "driver.late_policy = 'drop'"),
    (["compression.kind=topk", "secagg.enabled=true"], "cannot line up"),
    (["compression.kind=topk", "secagg.enabled=true", "driver.kind=fedbuff"], "cannot line up"),
    (["compression.kind=topk", "compression.shared_pattern=true", "secagg.enabled=true",
      "dp.mode=distributed", "dp.clip=1.0", "dp.noise_multiplier=1.0"],
     "distributed DP encodes the whole vector"),
    (["compression.kind=topk", "compression.shared_pattern=true", "secagg.enabled=true",
      "driver.kind=fedasync"], "a single update cannot be hidden in a sum"),
    (["compression.kind=qsgd", "secagg.enabled=true"], "set compression.bits >= 8"),
    (["compression.kind=qsgd", "compression.bits=8", "secagg.enabled=true", "secagg.bits=24"],
     "drop secagg.bits"),
    (["compression.kind=qsgd", "compression.bits=8", "secagg.enabled=true",
      "secagg.rounding=nearest"], "secagg.rounding"),
])
def test_bad_compression_config_fails_at_start(overrides, fragment):
    with pytest.raises(ValueError) as err:
        load_scenario("default", overrides)
    assert fragment in str(err.value)


def test_defaults():
    cfg = load_scenario("default", ["compression.kind=topk"])["compression"]
    assert (cfg["fraction"], cfg["error_feedback"]) == (0.1, True)
    assert load_scenario("default", ["compression.kind=qsgd"])["compression"][
        "error_feedback"] is False
    assert load_scenario("default")["compression"]["kind"] == "none"


@pytest.mark.parametrize(("bits", "weight_by", "cap"), [(8, "examples", 1000.0),
                                                        (10, "uniform", 1.0)])
def test_secure_qsgd_picks_the_smallest_modulus_for_its_levels(bits, weight_by, cap):
    config = load_scenario("default", ["compression.kind=qsgd", f"compression.bits={bits}",
                                       "secagg.enabled=true", "federation.clients=8",
                                       f"aggregation.weight_by={weight_by}"])
    secagg = config["secagg"]
    assert secagg["rounding"] == "stochastic"

    def levels(modulus_bits: int) -> int:  # a client's levels when 8 clients share the sum
        return max_level(1.0, max_scale(8, modulus_bits, 1.0, cap), cap)

    assert levels(secagg["bits"]) >= 2**bits > levels(secagg["bits"] - 1)
