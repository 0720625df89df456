"""Bad messages are rejected with a stored reason; the round goes on without the sender."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.secagg import CLASSIC, MECHANICS_ONLY, ProtocolError, Stage, Status, run_secagg_round
from privacy.secagg import messages as m
from privacy.secagg.messages import Header, MsgType, RevealedShare, ShareKind, read_header

N, DIM = 6, 50


def _tamper_share_ciphertext(sender: int):
    """Flip one tag byte of the first share ``sender`` sends."""

    def hook(stage, src, dst, payload):
        if src == sender and read_header(payload).kind is MsgType.SHARE_KEYS:
            buf = bytearray(payload)
            buf[m.HEADER.size + 4 + 8 + m.CIPHERTEXT_BYTES - 1] ^= 0x01
            return bytes(buf)
        return payload

    return hook


def test_tampered_ciphertext_rejects_its_sender(make_inputs, exact_sum):
    inputs = make_inputs(N, DIM, 32)
    total, server = run_secagg_round(inputs, k=N - 1, t=3, intercept=_tamper_share_ciphertext(3),
                                     flow=CLASSIC)  # reported with the masked input
    assert server.status is Status.COMPLETED
    assert "failed authentication (AES-GCM tag)" in server.rejected[3]
    assert 3 not in server.survivors
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 2, 4, 5, 6], 32))


def test_message_replayed_from_another_round_or_run_is_rejected(make_inputs, exact_sum):
    inputs = make_inputs(N, DIM, 32)
    captured = {}

    def capture(stage, src, dst, payload):
        if src is not None:
            captured[(src, read_header(payload).kind)] = payload
        return payload

    run_secagg_round(inputs, k=N - 1, t=3, round_id=1, intercept=capture)

    def replay(kind: MsgType, client: int):
        def hook(stage, src, dst, payload):
            if src == client and read_header(payload).kind is kind:
                return captured[(client, kind)]
            return payload

        return hook

    total, server = run_secagg_round(
        inputs, k=N - 1, t=3, round_id=2, intercept=replay(MsgType.ADVERTISE_KEYS, 4)
    )
    assert "replayed or misdirected" in server.rejected[4]
    assert "round 1" in server.rejected[4]
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 2, 3, 5, 6], 32))

    total, server = run_secagg_round(
        inputs, k=N - 1, t=3, run_id=9, round_id=1,
        intercept=replay(MsgType.SHARES_AND_INPUT, 2),  # the merged flow's masked input
    )
    assert "replayed or misdirected" in server.rejected[2] and "run 0" in server.rejected[2]
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 3, 4, 5, 6], 32))


def test_client_refuses_server_message_from_another_round(lockstep, make_inputs):
    inputs = make_inputs(3, DIM, 32)
    old = lockstep(inputs, k=2, t=2, round_id=1)
    old.step()
    new = lockstep(inputs, k=2, t=2, round_id=2)
    new.step()
    with pytest.raises(ProtocolError, match="round 1"):
        new.clients[1].handle(old.outbox[1])


def test_share_to_non_neighbour_rejects_sender(lockstep, make_inputs):
    inputs = make_inputs(8, DIM, 32)
    r = lockstep(inputs, k=3, t=2)
    r.step()
    replies = r.deliver()
    nbrs = r.server.neighbours[1]
    stranger = min(set(range(2, 9)) - nbrs)
    h, msg = m.decode_share_keys(replies[1])
    forged = ((stranger, msg.shares[0][1]), *msg.shares[1:])
    replies[1] = m.encode_share_keys(h, m.ShareKeys(forged))
    for c, payload in replies.items():
        r.server.receive(c, payload)
    assert r.server.rejected[1] == f"share addressed to client {stranger}, not a neighbour"
    r.outbox = r.server.advance()
    assert 1 not in r.outbox


def test_client_refuses_share_from_non_neighbour(lockstep, make_inputs):
    r = lockstep(make_inputs(8, DIM, 32), k=3, t=2)
    r.step()
    r.step()
    stranger = min(set(range(2, 9)) - r.server.neighbours[1])
    h, msg = m.decode_forwarded_shares(r.outbox[1])
    _, ct = msg.shares[0]
    forged = m.encode_forwarded_shares(h, m.ForwardedShares(((stranger, ct), *msg.shares[1:])))
    with pytest.raises(ProtocolError, match=f"share from client {stranger}, not a neighbour"):
        r.clients[1].handle(forged)
    r.clients[1].handle(r.outbox[1])  # state unchanged by the refusal


def test_client_refuses_share_from_unknown_sender(make_inputs, exact_sum):
    inputs = make_inputs(8, DIM, 32)
    errors: dict[int, str] = {}

    def forge(stage, src, dst, payload):
        if dst == 1 and read_header(payload).kind is MsgType.FORWARDED_SHARES:
            h, msg = m.decode_forwarded_shares(payload)
            _, ct = msg.shares[0]
            return m.encode_forwarded_shares(h, m.ForwardedShares(((99, ct), *msg.shares[1:])))
        return payload

    total, server = run_secagg_round(inputs, k=4, t=3, intercept=forge, client_errors=errors,
                                     flow=CLASSIC)  # FORWARDED_SHARES: the classic flow's
    assert errors == {1: "share from client 99, not a neighbour"}
    assert server.dropouts[Stage.MASKED_INPUT] == {1}
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, range(2, 9), 32))


def _unmask_stage(lockstep, make_inputs, n=5):
    r = lockstep(make_inputs(n, DIM, 32), k=n - 1, t=3)
    r.step()
    r.step()
    r.step()
    assert r.server.stage is Stage.UNMASKING
    return r


def test_client_refuses_request_for_both_shares_of_a_peer(lockstep, make_inputs):
    r = _unmask_stage(lockstep, make_inputs)
    client = r.clients[1]
    h = Header(MsgType.UNMASK_REQUEST, 0, 0, 1)
    both = m.encode_unmask_request(h, m.UnmaskRequest((2, 3), (3,)))
    with pytest.raises(ProtocolError, match="both surviving and dropped"):
        client.handle(both)
    # across two requests: first the self-mask share of 2, then its masking-key share
    client.handle(m.encode_unmask_request(h, m.UnmaskRequest((2, 4), ())))
    with pytest.raises(ProtocolError, match="both shares of client 2"):
        client.handle(m.encode_unmask_request(h, m.UnmaskRequest((4, 5), (2,))))
    # the same kind again is harmless
    client.handle(m.encode_unmask_request(h, m.UnmaskRequest((2, 4), ())))


def test_server_rejects_response_carrying_both_shares(lockstep, make_inputs, exact_sum):
    r = _unmask_stage(lockstep, make_inputs)
    replies = r.deliver()
    h, resp = m.decode_unmask_response(replies[1])
    extra = RevealedShare(2, ShareKind.MASK_KEY, bytes(33))
    replies[1] = m.encode_unmask_response(h, m.UnmaskResponse((*resp.shares, extra)))
    for c, payload in replies.items():
        r.server.receive(c, payload)
    assert r.server.rejected[1] == "response carries both shares of client 2"
    r.server.advance()
    assert r.server.status is Status.COMPLETED  # 1's input stays in the sum
    np.testing.assert_array_equal(r.server.result(), exact_sum(r.inputs, range(1, 6), 32))


def test_duplicate_malformed_unknown_and_impersonating_senders(lockstep, make_inputs):
    r = lockstep(make_inputs(6, DIM, 32), k=5, t=3)
    replies = r.deliver()
    s = r.server
    assert s.receive(1, replies[1])
    assert not s.receive(1, replies[1])
    assert s.rejected[1] == "duplicate message in stage ADVERTISE_KEYS"
    assert not s.receive(2, replies[2][:-1])
    assert s.rejected[2] == "message truncated"
    assert not s.receive(3, replies[3] + b"\0")
    assert s.rejected[3] == "1 trailing bytes"
    assert not s.receive(4, replies[5])
    assert s.rejected[4] == "header names client 5, sent by 4"
    assert not s.receive(77, replies[6])
    assert s.rejected[77] == "not a participant of this round"
    assert not s.receive(6, b"\x00" * 10)
    assert "truncated" in s.rejected[6]
    assert s.receive(5, replies[5])
    assert not s.receive(4, replies[4])  # rejected clients are not heard again
    assert s.ignored[-1] == (4, "already rejected (ADVERTISE_KEYS)")
    assert set(s.rejected) == {1, 2, 3, 4, 6, 77}
    assert s.advance() == {}
    assert s.status is Status.ABORTED and s.excluded == {
        5: "only 0 neighbours left with keys in stage ADVERTISE_KEYS, threshold 3"
    }


def test_wrong_message_type_and_bad_vector_are_rejected(lockstep, make_inputs, exact_sum):
    inputs = make_inputs(5, DIM, 12)
    # two survivors: the rejections' mechanics, below the policy's three on purpose
    r = lockstep(inputs, k=4, t=1, bits=12, policy=MECHANICS_ONLY)  # 12-bit words: uint16
    first = r.step()
    r.step()
    replies = r.deliver()
    s = r.server
    assert not s.receive(1, first[1])
    assert s.rejected[1] == "ADVERTISE_KEYS message in stage MASKED_INPUT"
    h, msg = m.decode_masked_input(replies[2])
    big = msg.vector.copy()
    assert big.dtype == np.uint16
    big[0] = 1 << 12
    assert not s.receive(2, m.encode_masked_input(h, m.MaskedInput(msg.failed, big)))
    assert s.rejected[2] == "masked vector has values >= 2^12"
    short = msg.vector[:-1].copy()
    assert not s.receive(
        3, m.encode_masked_input(read_header(replies[3]), m.MaskedInput((), short))
    )
    assert "expected 50 of 2" in s.rejected[3]
    for c in (4, 5):
        assert s.receive(c, replies[c])
    r.outbox = s.advance()
    r.step()
    assert s.status is Status.COMPLETED
    np.testing.assert_array_equal(s.result(), exact_sum(inputs, [4, 5], 12))


def _corrupt_b_share_of(peer: int, responder: int):
    def hook(stage, src, dst, payload):
        if src == responder and read_header(payload).kind is MsgType.UNMASK_RESPONSE:
            h, resp = m.decode_unmask_response(payload)
            shares = tuple(
                RevealedShare(
                    s.peer, s.kind, (int.from_bytes(s.share, "little") ^ 1).to_bytes(33, "little")
                )
                if s.peer == peer and s.kind is ShareKind.SELF_MASK
                else s
                for s in resp.shares
            )
            return m.encode_unmask_response(h, m.UnmaskResponse(shares))
        return payload

    return hook


def test_corrupted_share_is_caught_by_the_commitment(make_inputs, exact_sum):
    inputs = make_inputs(5, DIM, 32)
    # t = 3 of 4 holders: the first subset holds the bad share, the second does not
    total, server = run_secagg_round(inputs, k=4, t=3, intercept=_corrupt_b_share_of(2, 1))
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, range(1, 6), 32))
    # t = 4 of 4 holders: every subset holds it, so the round aborts instead of a wrong sum
    total, server = run_secagg_round(inputs, k=4, t=4, intercept=_corrupt_b_share_of(2, 1))
    assert total is None and server.status is Status.ABORTED
    assert "client 2's self-mask (commitment)" in server.abort_reason


def test_duplicate_masked_input_is_taken_back_out_of_the_sum(lockstep, make_inputs, exact_sum):
    inputs = make_inputs(5, DIM, 32)
    r = lockstep(inputs, k=4, t=3)
    r.step()
    r.step()
    replies = r.deliver()
    s = r.server
    for c in (1, 2, 3, 4, 5):
        assert s.receive(c, replies[c])
    assert not s.receive(2, replies[2])  # its vector was already added as it arrived
    assert s.rejected[2] == "duplicate message in stage MASKED_INPUT"
    r.outbox = s.advance()
    r.step()
    assert s.status is Status.COMPLETED and 2 not in s.survivors
    np.testing.assert_array_equal(s.result(), exact_sum(inputs, [1, 3, 4, 5], 32))
