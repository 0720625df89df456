"""Property tests: every decoder and validator of what a client or the server receives
either returns a well-formed value or raises its own documented error, for any input."""

from __future__ import annotations

import itertools
import math
import os
import struct

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from aggregation import Layout, Pipeline, Update, Validate, Weight, WeightedMean
from client.protocol.errors import WireError
from client.protocol.keys import MetricKey
from client.protocol.npy import NPY_STYPE, npy_array, npy_view
from client.protocol.updates import delta_record, model_record
from privacy.secagg import ProtocolError, SessionParams
from privacy.secagg import messages as m
from privacy.secagg.messages import (
    Header,
    MsgType,
    PeerKeys,
    RevealedShare,
    ShareKind,
    read_header,
)
from server.replies import _decode, _plain_delta_reply, decode_train_reply
from server.rounds import update_record
from server.store import Store
from simulations.inprocess import InProcessGrid

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
INT64_MAX = 2**63 - 1
F32_MAX = float(np.finfo(np.float32).max)

# ---------------------------------------------------------------- the update validator

DIM, VERSION = 5, 4
_any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
_deltas = st.one_of(
    arrays(np.float32, DIM, elements=_any_f32),
    arrays(np.float32, st.integers(0, 2 * DIM), elements=st.floats(-1e3, 1e3, width=32)),
    arrays(st.sampled_from([np.float64, np.float16, np.int32, np.dtype(">f4")]), DIM),
)
_counts = st.one_of(st.integers(-2, 2**64), st.floats(allow_nan=True),
                    st.integers(-3, 3).map(np.int64), st.integers(0, 2**64 - 1).map(np.uint64),
                    st.booleans(), st.none(), st.text(max_size=2))


def _valid(u: Update, max_norm: float) -> bool:
    """Validity as documented, computed independently (in float64)."""
    d, n, b = u.delta, u.num_examples, u.base_version
    if d.dtype != np.float32 or d.shape != (DIM,) or not np.isfinite(d).all():
        return False
    sq = float(np.sum(d.astype(np.float64) ** 2))
    assume(not 0.99 * F32_MAX < sq < 1.01 * F32_MAX)  # float32 rounding decides there
    assume(abs(math.sqrt(sq) - max_norm) > 1e-4 * max_norm)
    if sq > F32_MAX or math.sqrt(sq) > max_norm:
        return False
    integral = isinstance(n, int | np.integer) and not isinstance(n, bool)
    return integral and 1 <= int(n) <= INT64_MAX and b <= VERSION


@PROPERTY
@given(delta=_deltas, n=_counts, base=st.integers(0, VERSION + 2),
       max_norm=st.floats(1e-3, 1e6))
def test_validator_accepts_exactly_the_valid_updates(delta, n, base, max_norm):
    pipe = Pipeline(Validate(max_norm=max_norm), Weight("examples"), WeightedMean())
    agg = pipe.open_round(dim=DIM, version=VERSION)
    update = Update("c", delta, n, base)
    expected = _valid(update, max_norm)
    verdict = agg.submit(update)  # never raises
    assert verdict.accepted == expected, verdict
    if expected:
        assert verdict.weight == float(n) and verdict.norm <= max_norm
        np.testing.assert_allclose(agg.finish(), delta, rtol=1e-6)  # the weighted mean
    else:
        assert verdict.reason and agg.finish() is None


# ---------------------------------------------------------------- .npy decoding

def _npy_header(shape: tuple, descr: object, fortran: bool, version: int) -> bytes:
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    body = text.encode("latin1")
    width = 2 if version == 1 else 4
    body += b" " * (63 - (8 + width + len(body)) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(body).to_bytes(width, "little") + body


def _npy(arr_bytes: bytes) -> Array:
    return Array(dtype="float32", shape=(1,), stype=NPY_STYPE, data=arr_bytes)


def _check_view(data: bytes) -> None:
    """npy_view of ``data`` is a WireError or an array that is exactly the payload."""
    try:
        view = npy_view(_npy(data))
    except WireError:
        return
    assert view.nbytes == len(view.tobytes()) and math.prod(view.shape) == view.size
    assert data.endswith(view.tobytes()) and not view.flags.writeable


@PROPERTY
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_are_an_array_or_a_wire_error(data):
    _check_view(data)
    _check_view(b"\x93NUMPY\x01\x00" + data)


@PROPERTY
@given(shape=st.one_of(st.lists(st.integers(-3, 8), max_size=4).map(tuple),
                       st.tuples(st.integers(-2**63, 2**64)),
                       st.tuples(st.integers(2**31, 2**40), st.integers(2**31, 2**40)),
                       st.just("(1,"), st.just([2])),
       descr=st.sampled_from(["<f4", ">f4", "<f8", "|V0", "<U0", "|S0", "<U3", "|b1", "|O",
                              "<c8", "<M8[s]", "[('a', '<f4')]", "zz", 5, "<i8"]),
       fortran=st.one_of(st.booleans(), st.just("no")), version=st.sampled_from([1, 2, 3, 0]),
       payload=st.integers(0, 80))
def test_crafted_headers_are_an_array_or_a_wire_error(shape, descr, fortran, version,
                                                      payload):
    _check_view(_npy_header(shape, descr, fortran, version) + bytes(payload))


@PROPERTY
@given(a=arrays(st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.uint64,
                                 np.dtype(">f4"), np.bool_]),
                array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)),
       cut=st.integers(0, 10_000), extra=st.binary(min_size=1, max_size=9),
       pos=st.integers(0, 10_000), value=st.integers(0, 255))
def test_npy_round_trip_and_its_mutations(a, cut, extra, pos, value):
    data = npy_array(a).data
    back = npy_view(_npy(data))
    assert back.dtype == a.dtype and back.shape == a.shape
    assert back.tobytes() == np.ascontiguousarray(a).tobytes()
    cut %= len(data)
    with pytest.raises(WireError):
        npy_view(_npy(data[:cut]))  # truncated
    with pytest.raises(WireError):
        npy_view(_npy(data + extra))  # oversized
    flipped = bytearray(data)
    flipped[pos % len(data)] = value
    _check_view(bytes(flipped))


# ---------------------------------------------------------------- server: reply decoding

LAYOUT = Layout(("w", "b"), ((2, 3), (3,)), ("float32", "float32"))
BASE = np.linspace(-1, 1, LAYOUT.dim).astype(np.float32)
SENT_VERSION = 3


@pytest.fixture(scope="module")
def reply_store(tmp_path_factory):
    InProcessGrid(lambda msg, ctx: msg, 1)  # sets the task identity Flower's messages read
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('replies') / 'fedring.db'}")
    run_id = store.create_run(config={}, seed=0)
    yield store, run_id, itertools.count(1)
    store.close()


_metric_values = st.one_of(
    st.integers(-3, 3), st.integers(2**62, 2**64), st.integers(10**300, 10**320),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-2, 2), max_size=2), st.lists(st.floats(-1, 1), max_size=2))
_metrics = st.dictionaries(
    st.sampled_from([MetricKey.NUM_EXAMPLES, MetricKey.BASE_VERSION, "train_loss", "x"]),
    st.one_of(_metric_values, st.just(5), st.just(SENT_VERSION)), max_size=4)
_arrays = st.one_of(
    arrays(np.float32, LAYOUT.dim, elements=_any_f32),
    arrays(st.sampled_from([np.float32, np.float64, np.int32]),
           array_shapes(min_dims=1, max_dims=2, max_side=8)),
)


@st.composite
def _array(draw) -> Array:
    kind = draw(st.sampled_from(["npy", "npy", "bytes", "stype"]))
    if kind == "npy":
        return npy_array(draw(_arrays))
    data = draw(st.binary(max_size=64))
    return Array(dtype="float32", shape=(1,), stype=NPY_STYPE if kind == "bytes"
                 else "torch.save", data=data)


@st.composite
def _record_value(draw):
    kind = draw(st.sampled_from(["array", "metrics", "config"]))
    if kind == "array":
        names = draw(st.lists(st.sampled_from(["delta", "w", "b", "x"]), max_size=3,
                              unique=True))
        return ArrayRecord({n: draw(_array()) for n in names})
    if kind == "metrics":
        return MetricRecord(draw(_metrics))
    return ConfigRecord({"k": draw(st.one_of(st.integers(), st.text(max_size=3)))})


@st.composite
def _replies(draw) -> tuple[Message, Message]:
    msg = Message(RecordDict(), 7, "train", group_id="1")
    msg.metadata.__dict__["_message_id"] = "m1"
    if draw(st.integers(0, 9)) == 0:
        return msg, Message(Error(2, draw(st.text(max_size=10))), reply_to=msg)
    content = {"metrics": MetricRecord({MetricKey.NUM_EXAMPLES: 5,
                                        MetricKey.BASE_VERSION: SENT_VERSION})}
    if draw(st.booleans()):  # a fedring delta reply, else Flower's full weights
        content["delta"] = delta_record(draw(_arrays))
    else:
        content["arrays"] = model_record(LAYOUT, BASE + np.float32(0.5))
    content.update(draw(st.dictionaries(st.sampled_from(["delta", "metrics", "arrays", "x"]),
                                        _record_value(), max_size=2)))
    reply = Message(RecordDict(content), reply_to=msg)
    reply.metadata.__dict__["_message_type"] = draw(
        st.sampled_from(["train", "train", "train.x", "evaluate", "query"]))
    return msg, reply


@PROPERTY
@given(pair=_replies())
def test_any_reply_decodes_to_a_valid_update_or_a_wire_error_and_is_stored(pair,
                                                                         reply_store):
    store, run_id, rounds = reply_store
    _, reply = pair
    agg = Pipeline(Validate(), Weight("examples"), WeightedMean()).open_round(
        dim=LAYOUT.dim, version=SENT_VERSION)
    try:
        update = decode_train_reply(reply, client_id="7", layout=LAYOUT, base_params=BASE,
                                    version=SENT_VERSION)
    except WireError as exc:
        assert str(exc)
        record = update_record(agg.reject("7", str(exc)))
    else:
        assert isinstance(update.num_examples, int) and 1 <= update.num_examples <= INT64_MAX
        assert update.base_version == SENT_VERSION
        assert all(math.isfinite(v) for v in update.metrics.values())
        record = update_record(agg.submit(update), update.metrics)  # never raises
    rnd = next(rounds)  # the store takes whatever the server records about it
    store.record_round(run_id, round=rnd, model_version=0, metrics={}, updates=[record])
    assert store.updates(run_id, round=rnd)[0][1].fate == record.fate


@PROPERTY
@given(pair=_replies())
def test_the_plain_reply_path_decodes_as_the_full_checks_do(pair, reply_store):
    """Usual replies take a lean path; whatever it decodes, the full checks decode to the
    same update (delta, count, version, metrics in order), and whatever it refuses (a
    malformed delta), they refuse with the same reason. (``reply_store`` sets the task
    identity that Flower's messages read.)"""
    _, reply = pair
    try:
        plain = _plain_delta_reply(reply, "7", SENT_VERSION)
    except WireError as exc:
        plain = exc
    try:
        full = _decode(reply, client_id="7", layout=LAYOUT, base_params=BASE,
                       version=SENT_VERSION, codec=None)
    except WireError as exc:
        assert plain is None or str(plain) == str(exc), (plain, exc)
        return
    assert not isinstance(plain, WireError), plain
    if plain is not None:
        assert (plain.client_id, plain.num_examples, plain.base_version) == \
            (full.client_id, full.num_examples, full.base_version)
        assert type(plain.num_examples) is type(full.num_examples)
        assert list(plain.metrics.items()) == list(full.metrics.items())
        assert all(type(v) is float for v in plain.metrics.values())
        np.testing.assert_array_equal(plain.delta, full.delta)
        assert plain.delta.dtype == full.delta.dtype


def test_the_usual_reply_takes_the_plain_path(reply_store):
    reply = Message(RecordDict({
        "delta": delta_record(np.ones(LAYOUT.dim, np.float32)),
        "metrics": MetricRecord({MetricKey.NUM_EXAMPLES: 5, "train_loss": 0.5,
                                 MetricKey.BASE_VERSION: SENT_VERSION,
                                 MetricKey.PARTITION: 2})}), 7, "train")
    plain = _plain_delta_reply(reply, "7", SENT_VERSION)
    assert plain is not None and plain.num_examples == 5
    assert plain.metrics == {MetricKey.NUM_EXAMPLES: 5.0, "train_loss": 0.5,
                             MetricKey.BASE_VERSION: float(SENT_VERSION),
                             MetricKey.PARTITION: 2.0}
    assert _plain_delta_reply(reply, "7", SENT_VERSION + 1) is None  # another version


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 10**400, 2**64, True,
                                   [1.0], np.float32(0.5)])
def test_a_metric_the_full_checks_refuse_or_convert_leaves_the_plain_path(value, reply_store):
    reply = Message(RecordDict({
        "delta": delta_record(np.ones(LAYOUT.dim, np.float32)),
        "metrics": MetricRecord({MetricKey.NUM_EXAMPLES: 5, MetricKey.BASE_VERSION: 3})}),
        7, "train")
    reply.content["metrics"].__dict__["_data"]["x"] = value  # however it got there
    assert _plain_delta_reply(reply, "7", SENT_VERSION) is None
    try:
        update = decode_train_reply(reply, client_id="7", layout=LAYOUT, base_params=BASE,
                                    version=SENT_VERSION)
    except WireError as exc:
        assert "metric 'x' is not a finite number" in str(exc)
    else:  # a bool, a list or a numpy float32 is not a scalar metric: left out
        if isinstance(value, int) and not isinstance(value, bool):
            assert update.metrics["x"] == float(value)  # beyond int64, kept as a float
        else:
            assert "x" not in update.metrics


# ---------------------------------------------------------------- secure aggregation

CONFIG = SessionParams.create([3, 9, 12, 40], 5, bits=20, k=3, t=2, run_id=11, round_id=4)


def _h(kind: MsgType) -> Header:
    return Header(kind, 11, 4, 9)


def _ct() -> bytes:
    return os.urandom(m.CIPHERTEXT_BYTES)


SAMPLES: dict[MsgType, bytes] = {
    MsgType.SETUP: m.encode_setup(CONFIG, 9),
    MsgType.ADVERTISE_KEYS: m.encode_advertise_keys(
        _h(MsgType.ADVERTISE_KEYS), m.AdvertiseKeys(b"c" * 32, b"s" * 32, b"b" * 32)),
    MsgType.PUBLIC_KEYS: m.encode_public_keys(_h(MsgType.PUBLIC_KEYS), m.PublicKeys(
        (PeerKeys(3, b"a" * 32, b"b" * 32), PeerKeys(40, b"x" * 32, b"y" * 32)))),
    MsgType.SHARE_KEYS: m.encode_share_keys(_h(MsgType.SHARE_KEYS),
                                            m.ShareKeys(((3, _ct()), (12, _ct())))),
    MsgType.FORWARDED_SHARES: m.encode_forwarded_shares(
        _h(MsgType.FORWARDED_SHARES), m.ForwardedShares(((40, _ct()), (3, _ct())))),
    MsgType.MASKED_INPUT: bytes(m.encode_masked_input(
        _h(MsgType.MASKED_INPUT), m.MaskedInput((12,), np.arange(5, dtype=np.uint32)))),
    MsgType.UNMASK_REQUEST: m.encode_unmask_request(_h(MsgType.UNMASK_REQUEST),
                                                    m.UnmaskRequest((3, 12), (40,))),
    MsgType.UNMASK_RESPONSE: m.encode_unmask_response(_h(MsgType.UNMASK_RESPONSE),
                                                      m.UnmaskResponse((
        RevealedShare(3, ShareKind.SELF_MASK, b"\1" * 32 + b"\0"),
        RevealedShare(40, ShareKind.MASK_KEY, b"\2" * 32 + b"\0")))),
    MsgType.CONSISTENCY_CHECK: m.encode_consistency_check(_h(MsgType.CONSISTENCY_CHECK),
                                                          m.ConsistencyCheck((3, 12, 40))),
}
# the merged flow: the masked input with the shares, the shares with the next message
SAMPLES[MsgType.SHARES_AND_INPUT] = m.shares_and_input_head(
    _h(MsgType.SHARES_AND_INPUT), m.ShareKeys(((3, _ct()), (12, _ct()), (40, _ct()))), 5,
    np.dtype("<u4")) + np.arange(5, dtype="<u4").tobytes()
SAMPLES[MsgType.SHARES_AND_CHECK] = m.with_shares(
    SAMPLES[MsgType.CONSISTENCY_CHECK], m.ForwardedShares(((40, _ct()), (3, _ct()))))
SAMPLES[MsgType.SHARES_AND_UNMASK] = m.with_shares(
    SAMPLES[MsgType.UNMASK_REQUEST], m.ForwardedShares(((12, _ct()),)))
KINDS = sorted(SAMPLES)


def _reencode(header: Header, body: object) -> bytes:
    """The canonical bytes of a decoded message."""
    if header.kind is MsgType.SETUP:
        return m.encode_setup(body, header.client_id)
    encoder = {MsgType.ADVERTISE_KEYS: m.encode_advertise_keys,
               MsgType.PUBLIC_KEYS: m.encode_public_keys,
               MsgType.SHARE_KEYS: m.encode_share_keys,
               MsgType.FORWARDED_SHARES: m.encode_forwarded_shares,
               MsgType.MASKED_INPUT: m.encode_masked_input,
               MsgType.UNMASK_REQUEST: m.encode_unmask_request,
               MsgType.UNMASK_RESPONSE: m.encode_unmask_response,
               MsgType.CONSISTENCY_CHECK: m.encode_consistency_check}[header.kind]
    return bytes(encoder(header, body))


def _decoded_canonically(kind: MsgType, data: bytes | bytearray | memoryview) -> bytes:
    """Decode ``data`` as ``kind`` (ProtocolError if refused); the canonical bytes of what
    was decoded. A message carrying forwarded shares decodes in two steps, as the client
    does: the shares, then the message they travel with."""
    if kind in (MsgType.SHARES_AND_CHECK, MsgType.SHARES_AND_UNMASK):
        _, shares, rest = m.DECODERS[kind](data)
        inner = m.DECODERS[read_header(rest).kind](rest)
        return m.with_shares(_reencode(*inner), shares)
    if kind is MsgType.SHARES_AND_INPUT:
        header, shares, masked = m.DECODERS[kind](data)
        vector = masked.vector
        return m.shares_and_input_head(header, shares, vector.size, vector.dtype) + \
            vector.tobytes()
    return _reencode(*m.DECODERS[kind](data))


_COUNT_AT = m.HEADER.size  # where the first u32 count (or SETUP's n) of a body lies


@st.composite
def _mutations(draw) -> tuple[MsgType, bytes]:
    """A valid message, structurally mutated: spliced, cut, grown, re-counted, re-typed."""
    kind = draw(st.sampled_from(KINDS))
    data = bytearray(SAMPLES[kind])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["insert", "delete", "count", "type", "append", "dup"]))
        at = draw(st.integers(0, len(data)))
        if op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=40))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 40))]
        elif op == "count" and len(data) >= _COUNT_AT + 4:
            value = draw(st.one_of(st.integers(0, 5), st.sampled_from([2**20, 2**20 + 1,
                                                                        2**32 - 1])))
            offset = _COUNT_AT + 4 * draw(st.integers(0, 2))
            data[offset:offset + 4] = struct.pack("<I", value)[: len(data) - offset]
        elif op == "type" and len(data) > 3:
            data[3] = draw(st.sampled_from([int(k) for k in MsgType] + [0, 99]))
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "dup":
            data += data[_COUNT_AT:]
    return kind, bytes(data)


@PROPERTY
@given(mutated=_mutations(), as_type=st.sampled_from([bytes, bytearray, memoryview]))
def test_mutated_messages_decode_canonically_or_raise_protocol_error(mutated, as_type):
    kind, data = mutated
    for decoder_kind in (kind, MsgType(data[3]) if len(data) > 3 and data[3] in
                         set(MsgType) else kind):
        try:
            canonical = _decoded_canonically(decoder_kind, as_type(data))
        except ProtocolError as exc:
            assert exc.reason
            continue
        # Whatever is accepted is exactly the canonical encoding: nothing lenient.
        assert canonical == data


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_single_byte_change_is_refused_or_canonical(kind):
    """Each byte of a valid message changed in place (every position, two values): refused,
    or decoded to exactly those bytes; no byte (padding, reserved, counts) is read leniently."""
    data = SAMPLES[kind]
    for at in range(len(data)):
        for value in (data[at] ^ 0x01, data[at] ^ 0x80):
            changed = bytearray(data)
            changed[at] = value
            try:
                assert _decoded_canonically(kind, bytes(changed)) == bytes(changed)
            except ProtocolError as exc:
                assert exc.reason


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decoders_refuse_what_is_not_contiguous_bytes(kind):
    data = SAMPLES[kind]
    strided = memoryview(np.frombuffer(data * 2, dtype=np.uint8)[::2])
    for bad in (data.decode("latin1"), None, 7, list(data), strided):
        with pytest.raises(ProtocolError):
            m.DECODERS[kind](bad)
    header = m.DECODERS[kind](memoryview(np.frombuffer(data, dtype=np.uint8)))[0]
    assert header.kind is kind  # the same bytes, contiguous: fine


@PROPERTY
@given(shares=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 255),
                                 st.binary(min_size=33, max_size=33)), max_size=6))
def test_unmask_responses_with_any_fields(shares):
    h = _h(MsgType.UNMASK_RESPONSE)
    body = b"".join(struct.pack("<QB33s", *s) for s in shares)
    data = m.HEADER.pack(m.MAGIC, m.VERSION, MsgType.UNMASK_RESPONSE, 11, 4, 9) + \
        struct.pack("<I", len(shares)) + body
    try:
        header, decoded = m.decode_unmask_response(data)
    except ProtocolError:
        valid = (all(k in (0, 1) for _, k, _ in shares)
                 and len({(p, k) for p, k, _ in shares}) == len(shares)
                 and all(int.from_bytes(s, "little") < m.PRIME for _, _, s in shares))
        assert not valid
        return
    assert header == h and [(s.peer, int(s.kind), s.share) for s in decoded.shares] == shares
    assert all(int.from_bytes(s.share, "little") < m.PRIME for s in decoded.shares)

