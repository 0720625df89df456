"""Wire format: round trips, and fuzzed bytes never raise anything but ProtocolError."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privacy.secagg import ProtocolError, SecAggClient, SecAggServer, SessionParams
from privacy.secagg import messages as m
from privacy.secagg.messages import Header, MsgType, PeerKeys, RevealedShare, ShareKind

# the classic flow's SETUP: no optional mode byte, so every truncation is malformed
CONFIG = SessionParams.create([3, 9, 12, 40], 5, bits=20, k=3, t=2, run_id=11, round_id=4,
                              flow="classic")


def _h(kind: MsgType, client: int = 9) -> Header:
    return Header(kind, 11, 4, client)


def _ct() -> bytes:
    return os.urandom(m.CIPHERTEXT_BYTES)


SAMPLES: dict[MsgType, tuple[bytes, object]] = {}


def _sample(kind, encoder, body):
    data = encoder(_h(kind), body) if kind is not MsgType.SETUP else encoder(CONFIG, 9)
    SAMPLES[kind] = (data, body)


_sample(MsgType.SETUP, m.encode_setup, CONFIG)
_sample(
    MsgType.ADVERTISE_KEYS,
    m.encode_advertise_keys,
    m.AdvertiseKeys(b"c" * 32, b"s" * 32, b"b" * 32),
)
_sample(
    MsgType.PUBLIC_KEYS,
    m.encode_public_keys,
    m.PublicKeys((PeerKeys(3, b"a" * 32, b"b" * 32), PeerKeys(40, b"x" * 32, b"y" * 32))),
)
_sample(MsgType.SHARE_KEYS, m.encode_share_keys, m.ShareKeys(((3, _ct()), (12, _ct()))))
_sample(MsgType.FORWARDED_SHARES, m.encode_forwarded_shares, m.ForwardedShares(((40, _ct()),)))
_sample(
    MsgType.MASKED_INPUT,
    m.encode_masked_input,
    m.MaskedInput((12,), np.arange(5, dtype=np.uint32)),
)
_sample(MsgType.UNMASK_REQUEST, m.encode_unmask_request, m.UnmaskRequest((3, 12), (40,)))
_sample(
    MsgType.UNMASK_RESPONSE,
    m.encode_unmask_response,
    m.UnmaskResponse(
        (
            RevealedShare(3, ShareKind.SELF_MASK, b"\1" * 32 + b"\0"),
            RevealedShare(40, ShareKind.MASK_KEY, b"\2" * 32 + b"\0"),
        )
    ),
)
KINDS = sorted(SAMPLES)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_round_trip(kind):
    data, body = SAMPLES[kind]
    header, decoded = m.DECODERS[kind](data)
    assert m.read_header(data) == header and header.kind is kind
    if kind is MsgType.SETUP:
        assert decoded == CONFIG and header.client_id == 9
    elif kind is MsgType.MASKED_INPUT:
        assert decoded.failed == body.failed
        np.testing.assert_array_equal(decoded.vector, body.vector)
    else:
        assert decoded == body and header == _h(kind)
    assert m.decode(data)[1] is not None


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_decoder_refuses_every_other_type(kind):
    for other in KINDS:
        if other is not kind:
            with pytest.raises(ProtocolError, match="expected a"):
                m.DECODERS[kind](SAMPLES[other][0])


def test_header_checks():
    data = SAMPLES[MsgType.ADVERTISE_KEYS][0]
    with pytest.raises(ProtocolError, match="bad magic"):
        m.read_header(b"XX" + data[2:])
    with pytest.raises(ProtocolError, match="version 2"):
        m.read_header(data[:2] + b"\x02" + data[3:])
    with pytest.raises(ProtocolError, match="unknown message type 99"):
        m.read_header(data[:3] + b"\x63" + data[4:])
    with pytest.raises(ProtocolError, match="must be bytes"):
        m.read_header("text")  # type: ignore[arg-type]


def test_decoders_reject_duplicates_and_bad_values():
    h = _h(MsgType.UNMASK_RESPONSE)
    dup = m.UnmaskResponse((RevealedShare(3, ShareKind.SELF_MASK, b"\0" * 33),) * 2)
    with pytest.raises(ProtocolError, match="duplicate SELF_MASK share of client 3"):
        m.decode_unmask_response(m.encode_unmask_response(h, dup))
    big = m.UnmaskResponse((RevealedShare(3, ShareKind.SELF_MASK, b"\xff" * 33),))
    with pytest.raises(ProtocolError, match="outside the field"):
        m.decode_unmask_response(m.encode_unmask_response(h, big))
    for value, ok in ((2**256 + 296, True), (2**256 + 297, False)):  # the prime's edge
        share = RevealedShare(3, ShareKind.MASK_KEY, value.to_bytes(33, "little"))
        one = m.UnmaskResponse((share,))
        if ok:
            assert m.decode_unmask_response(m.encode_unmask_response(h, one))[1] == one
        else:
            with pytest.raises(ProtocolError, match="outside the field"):
                m.decode_unmask_response(m.encode_unmask_response(h, one))
    twice = m.ShareKeys(((3, _ct()), (3, _ct())))
    with pytest.raises(ProtocolError, match="duplicate client id"):
        m.decode_share_keys(m.encode_share_keys(_h(MsgType.SHARE_KEYS), twice))
    bad_setup = bytearray(SAMPLES[MsgType.SETUP][0])
    bad_setup[m.HEADER.size + 8 : m.HEADER.size + 12] = (9).to_bytes(4, "little")  # t > k
    with pytest.raises(ProtocolError, match="invalid configuration: t must be"):
        m.decode_setup(bytes(bad_setup))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes_only_raise_protocol_error(kind, data):
    for candidate in (data, m.HEADER.pack(m.MAGIC, m.VERSION, kind, 11, 4, 9) + data):
        with contextlib.suppress(ProtocolError):
            m.DECODERS[kind](candidate)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@FUZZ
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_truncated_messages_raise_protocol_error(kind, cut):
    data = SAMPLES[kind][0]
    cut %= len(data)
    with pytest.raises(ProtocolError):
        m.DECODERS[kind](data[:cut])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@FUZZ
@given(pos=st.integers(min_value=0, max_value=10_000), value=st.integers(0, 255))
def test_corrupted_bytes_decode_or_raise_protocol_error(kind, pos, value):
    data = bytearray(SAMPLES[kind][0])
    data[pos % len(data)] = value
    with contextlib.suppress(ProtocolError):
        m.DECODERS[kind](bytes(data))


@FUZZ
@given(data=st.binary(max_size=300), sender=st.sampled_from([3, 9, 12, 40, 5]))
def test_server_session_never_raises_on_garbage(data, sender):
    server = SecAggServer(CONFIG)
    server.start()
    assert server.receive(sender, data) is False
    assert sender in server.rejected
    server.advance()  # still closes cleanly


@FUZZ
@given(data=st.binary(max_size=300))
def test_client_and_client_state_only_raise_protocol_error(data):
    client = SecAggClient(9)
    client.handle(SAMPLES[MsgType.SETUP][0])
    for kind in (MsgType.PUBLIC_KEYS, MsgType.UNMASK_REQUEST):
        with contextlib.suppress(ProtocolError):
            client.handle(m.HEADER.pack(m.MAGIC, m.VERSION, kind, 11, 4, 9) + data)
    with contextlib.suppress(ProtocolError):
        SecAggClient.from_state(data)
    state = client.export_state()
    with contextlib.suppress(ProtocolError):
        SecAggClient.from_state(state[: len(data) % len(state)])
