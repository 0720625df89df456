"""The merged flow: the masked input rides on the share-keys reply, the forwarded shares on
the next server message; a fallback to the classic masked-input stage when shares are
missing; the client's rules on forwarded shares."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.secagg import (
    CLASSIC,
    MALICIOUS,
    MERGED,
    SEMI_HONEST,
    ProtocolError,
    SecAggClient,
    Stage,
    Status,
    run_secagg_round,
)
from privacy.secagg import messages as m
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.messages import MsgType, read_header

N, DIM = 6, 40
IDS = {c: Identity.generate() for c in range(1, N + 1)}
TRUST = TrustedKeys(i.public for i in IDS.values())
MODES = [SEMI_HONEST, MALICIOUS]


def _run(inputs, security, **kw):
    extra = {"identities": IDS, "trusted": TRUST} if security == MALICIOUS else {}
    return run_secagg_round(inputs, k=N - 1, t=3, security=security, **extra, **kw)


def _prompt_stages(security, flow, make_inputs, exact_sum, **kw):
    """The stages whose server messages were delivered, and the server."""
    inputs = make_inputs(N, DIM, 32)
    seen: list[Stage] = []

    def note(stage, src, dst, payload):
        if src is None and stage not in seen:
            seen.append(stage)
        return payload

    total, server = _run(inputs, security, intercept=note, flow=flow, **kw)
    assert server.status is Status.COMPLETED, server.abort_reason
    np.testing.assert_array_equal(total, exact_sum(inputs, sorted(server.survivors), 32))
    return seen, server


@pytest.mark.parametrize("security", MODES)
def test_the_merged_round_is_exact_with_one_exchange_fewer(security, make_inputs, exact_sum):
    merged, server = _prompt_stages(security, MERGED, make_inputs, exact_sum)
    classic, old = _prompt_stages(security, CLASSIC, make_inputs, exact_sum)
    assert len(merged) == len(classic) - 1 == (3 if security == SEMI_HONEST else 4)
    assert Stage.MASKED_INPUT not in merged and Stage.MASKED_INPUT in classic
    assert server.merged and not old.merged
    assert server.survivors == set(range(1, N + 1))
    assert Stage.MASKED_INPUT not in server.seconds  # the skipped stage has no time
    assert Stage.MASKED_INPUT in old.seconds


@pytest.mark.parametrize("security", MODES)
def test_a_dropout_at_share_keys_takes_the_fallback(security, make_inputs, exact_sum):
    sent: dict[MsgType, set[int]] = {}

    def note(stage, src, dst, payload):
        if src is not None:
            sent.setdefault(read_header(payload).kind, set()).add(src)
        return payload

    stages, server = _fallback(security, make_inputs, exact_sum, note)
    assert not server.merged and Stage.MASKED_INPUT in stages
    assert server.dropouts[Stage.SHARE_KEYS] == {4}
    assert server.survivors == {1, 2, 3, 5, 6}
    both = sent[MsgType.SHARES_AND_INPUT] & sent[MsgType.MASKED_INPUT]
    assert both == {1, 2, 3, 5, 6}  # masked twice: over U1, then over U2


def _fallback(security, make_inputs, exact_sum, note):
    inputs = make_inputs(N, DIM, 32)
    seen: list[Stage] = []

    def hook(stage, src, dst, payload):
        if src is None and stage not in seen:
            seen.append(stage)
        return note(stage, src, dst, payload)

    total, server = _run(inputs, security, intercept=hook, drop={4: Stage.SHARE_KEYS})
    assert server.status is Status.COMPLETED, server.abort_reason
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 2, 3, 5, 6], 32))
    return seen, server


@pytest.mark.parametrize("security", MODES)
def test_shares_without_a_masked_input_make_a_masked_input_dropout(security, make_inputs,
                                                                    exact_sum):
    stages, server = _prompt_stages(security, MERGED, make_inputs, exact_sum,
                                    drop={2: Stage.MASKED_INPUT})
    assert server.merged and Stage.MASKED_INPUT not in stages
    assert server.dropouts[Stage.MASKED_INPUT] == {2}
    assert server.survivors == {1, 3, 4, 5, 6}


@pytest.mark.parametrize("security", MODES)
def test_a_tampered_share_found_after_masking_rejects_its_sender(security, make_inputs,
                                                                 exact_sum):
    """The receiver finds it with the next message and reports it; the sender's vector is
    in the sum already and stays there (its self-mask rebuilt from the other holders)."""
    inputs = make_inputs(N, DIM, 32)

    def tamper(stage, src, dst, payload):
        if src == 3 and read_header(payload).kind is MsgType.SHARES_AND_INPUT:
            buf = bytearray(payload)
            buf[m.HEADER.size + 4 + 8 + m.CIPHERTEXT_BYTES - 1] ^= 0x01
            return buf
        return payload

    errors: dict[int, str] = {}
    total, server = _run(inputs, security, intercept=tamper, client_errors=errors)
    assert errors == {}
    assert server.status is Status.COMPLETED, server.abort_reason
    assert server.rejected[3] == "its share for client 1 failed authentication (AES-GCM tag)"
    np.testing.assert_array_equal(total, exact_sum(inputs, range(1, N + 1), 32))


# --- the client's rules on forwarded shares ------------------------------------------


def _merged(lockstep, make_inputs, **kw):
    return lockstep(make_inputs(N, DIM, 32), k=N - 1, t=3, flow=MERGED, **kw)


def test_a_second_set_of_shares_after_the_fallback_is_refused(lockstep, make_inputs):
    r = _merged(lockstep, make_inputs)
    r.step()
    r.step(skip=[4])  # 4 sends no shares: the fallback
    assert read_header(r.outbox[1]).kind is MsgType.FORWARDED_SHARES
    forwarded = m.decode_forwarded_shares(r.outbox[1])[1]
    r.step(skip=[4])
    assert read_header(r.outbox[1]).kind is MsgType.UNMASK_REQUEST
    again = m.with_shares(r.outbox[1], forwarded)
    with pytest.raises(ProtocolError, match="forwarded shares already received this round: "
                                            "a second set is refused"):
        r.clients[1].handle(again)
    h = read_header(r.outbox[1])
    twice = m.encode_forwarded_shares(m.Header(MsgType.FORWARDED_SHARES, h.run_id, h.round_id,
                                               1), forwarded)
    with pytest.raises(ProtocolError, match="a second set is refused"):
        r.clients[1].handle(twice)
    r.clients[1].handle(r.outbox[1])  # the request alone is answered


@pytest.mark.parametrize("security", MODES)
def test_shares_on_the_fast_path_are_taken_once(lockstep, make_inputs, security):
    inputs = make_inputs(N, DIM, 32)
    r = _malicious_or_not(lockstep, inputs, security)
    r.step()
    r.step()
    first = r.outbox[1]
    assert read_header(first).kind is (MsgType.SHARES_AND_UNMASK if security == SEMI_HONEST
                                       else MsgType.SHARES_AND_CHECK)
    h, forwarded, _ = m.split_shares(first)
    r.clients[1].handle(first)
    for second in (first, m.encode_forwarded_shares(
            m.Header(MsgType.FORWARDED_SHARES, h.run_id, h.round_id, 1), forwarded)):
        with pytest.raises(ProtocolError, match="a second set is refused"):
            r.clients[1].handle(second)


def _malicious_or_not(lockstep, inputs, security):
    if security == SEMI_HONEST:
        return lockstep(inputs, k=N - 1, t=3, flow=MERGED)
    r = lockstep(inputs, k=N - 1, t=3, flow=MERGED, security=MALICIOUS)
    for c in r.clients:
        r.clients[c] = SecAggClient(c, identity=IDS[c], trusted=TRUST, security=MALICIOUS)
        r.clients[c].set_input(inputs[c - 1])
    return r


@pytest.mark.parametrize("security", MODES)
def test_a_server_that_skips_shares_gets_no_unmasking_share(lockstep, make_inputs, security):
    inputs = make_inputs(N, DIM, 32)
    r = _malicious_or_not(lockstep, inputs, security)
    r.step()
    r.step()
    client = r.clients[1]
    _h, forwarded, rest = m.split_shares(r.outbox[1])
    with pytest.raises(ProtocolError, match="not expected after stage SHARE_KEYS"):
        client.handle(rest)  # the request without any share
    fewer = m.ForwardedShares(forwarded.shares[1:])  # one peer's ciphertext left out
    skipped = forwarded.shares[0][0]
    if security == SEMI_HONEST:
        with pytest.raises(ProtocolError, match=f"client {skipped}, whose shares this client "
                                                "lacks"):
            client.handle(m.with_shares(rest, fewer))
        assert client._revealed == {}
    else:
        client.handle(m.with_shares(rest, fewer))  # it signs; it holds no share of `skipped`
        assert skipped not in client.held_peers
    fresh = _malicious_or_not(lockstep, inputs, security)
    fresh.step()
    fresh.step()
    _, forwarded, rest = m.split_shares(fresh.outbox[1])
    short = m.ForwardedShares(forwarded.shares[:2])  # fewer than t
    with pytest.raises(ProtocolError, match="only 2 valid shares from neighbours"):
        fresh.clients[1].handle(m.with_shares(rest, short))


def test_the_client_refuses_the_other_flow(lockstep, make_inputs):
    classic = lockstep(make_inputs(N, DIM, 32), k=N - 1, t=3, flow=CLASSIC)
    merged = _merged(lockstep, make_inputs)
    for r in (classic, merged):
        r.step()
        r.step()
    _h, forwarded, _rest = m.split_shares(merged.outbox[1])
    classic.step()
    with pytest.raises(ProtocolError, match="SHARES_AND_UNMASK in a classic-flow session"):
        classic.clients[1].handle(m.with_shares(classic.outbox[1], forwarded))
    assert read_header(merged.deliver()[1]).kind is MsgType.UNMASK_RESPONSE


def test_shares_with_the_check_in_a_semi_honest_session_are_refused(lockstep, make_inputs):
    r = _merged(lockstep, make_inputs)
    r.step()
    r.step()
    h, forwarded, _rest = m.split_shares(r.outbox[1])
    check = m.encode_consistency_check(m.Header(MsgType.CONSISTENCY_CHECK, h.run_id,
                                                h.round_id, 1), m.ConsistencyCheck((1, 2, 3)))
    with pytest.raises(ProtocolError, match="SHARES_AND_CHECK in a semi_honest session"):
        r.clients[1].handle(m.with_shares(check, forwarded))


def test_merged_state_survives_export_and_restore(lockstep, make_inputs, exact_sum):
    """A client restored between messages keeps the merged flow's flag (a fresh process
    per message, as in a deployment); the fallback also works from a restored state."""
    for skip in ([], [4]):
        inputs = make_inputs(N, DIM, 32)
        r = lockstep(inputs, k=N - 1, t=3, flow=MERGED)
        while r.server.status is Status.RUNNING:
            for c in list(r.clients):
                r.clients[c] = SecAggClient.from_state(r.clients[c].export_state())
                r.clients[c].set_input(inputs[c - 1])
            r.step(skip=skip if r.server.stage >= Stage.SHARE_KEYS else [])
        survivors = [c for c in range(1, N + 1) if c not in skip]
        np.testing.assert_array_equal(r.server.result(), exact_sum(inputs, survivors, 32))
        assert r.server.merged == (not skip)


def test_merged_messages_round_trip():
    h = m.Header(MsgType.SHARES_AND_INPUT, 1, 2, 3)
    cts = m.ShareKeys(((5, bytes(range(m.CIPHERTEXT_BYTES))),))
    vec = np.arange(7, dtype=np.uint16)
    head = m.shares_and_input_head(h, cts, vec.size, vec.dtype)
    data = head + vec.tobytes()
    assert len(head) % 8 == 0
    got_h, got_cts, got = m.decode_shares_and_input(data)
    assert got_h == h and got_cts == cts and np.array_equal(got.vector, vec)
    for bad in (data[:-1], data + b"\0", data[:len(head) - 17] + b"\1" + data[len(head) - 16:]):
        with pytest.raises(ProtocolError):
            m.decode_shares_and_input(bad)
    req = m.encode_unmask_request(m.Header(MsgType.UNMASK_REQUEST, 1, 2, 3),
                                  m.UnmaskRequest((4,), (5,)))
    fwd = m.ForwardedShares(((4, bytes(m.CIPHERTEXT_BYTES)),))
    both = m.with_shares(req, fwd)
    assert read_header(both).kind is MsgType.SHARES_AND_UNMASK
    assert m.split_shares(both)[1:] == (fwd, req)
    resp = m.UnmaskResponse((), (4, 5))
    back = m.Header(MsgType.UNMASK_RESPONSE, 1, 2, 3)
    assert m.decode_unmask_response(m.encode_unmask_response(back, resp))[1] == resp
    with pytest.raises(ProtocolError, match="an empty failed-share list"):
        m.decode_consistency_reply(m.encode_consistency_signature(
            m.Header(MsgType.CONSISTENCY_SIGNATURE, 1, 2, 3), bytes(64)) + bytes(4))


def test_the_flow_travels_in_setup():
    for security in MODES:
        for flow in (MERGED, CLASSIC):
            config = m.SessionParams.create(range(1, 6), DIM, security=security, flow=flow)
            assert m.decode_setup(m.encode_setup(config, 1))[1] == config
