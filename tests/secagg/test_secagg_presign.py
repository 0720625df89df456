"""A pre-signed survivor set (``SessionParams.presign``, ``secagg.presign``): in a malicious
round whose keys came ahead each client signs S = the whole advertisement list with its
masked input (PRESIGNED_INPUT), the consistency check is skipped (2 exchanges), a missing
listed client aborts the round, and a lying server learns nothing more."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_secagg_ahead import IDS, RUN, AheadLyingRound, Run, _sum
from test_secagg_malicious import IDENTITIES, TRUST_ALL, signed_set

from privacy.secagg import MALICIOUS, ProtocolError, SecAggClient, SecAggServer, Stage, Status
from privacy.secagg import malicious as mal
from privacy.secagg import messages as msg
from privacy.secagg.messages import MsgType
from server.secagg_config import SecAggScenarioConfig


class PresignedRound(AheadLyingRound):
    """:class:`AheadLyingRound` with the survivor set pre-signed."""

    def __init__(self, n: int, **kw) -> None:
        super().__init__(n, **kw)
        self.config = dataclasses.replace(self.config, presign=True)
        ahead = {c: self.sent[(MsgType.ADVERTISE_KEYS, c)] for c in self.clients}
        self.server = SecAggServer(self.config, ahead=ahead)
        self.outbox = self.server.start()


def _own(c: int) -> dict:
    return {"identity": IDENTITIES[c], "trusted": TRUST_ALL, "security": MALICIOUS}


def test_a_warm_presigned_round_takes_two_exchanges_and_gives_the_same_sum():
    signed, usual = Run(MALICIOUS), Run(MALICIOUS)
    for rnd in range(1, 5):
        total, server, exchanges, inputs, errors = signed.round(rnd, presign=True)
        plain, other, usual_exchanges, _, _ = usual.round(rnd, presign=False)
        assert server.status is Status.COMPLETED, server.abort_reason
        assert errors == {}
        assert server.config.presign is (rnd > 1) and not other.config.presign
        assert exchanges == (2 if rnd > 1 else 4)
        assert usual_exchanges == (3 if rnd > 1 else 4)
        assert total.tobytes() == plain.tobytes()  # bit-identical
        np.testing.assert_array_equal(total, _sum(inputs, IDS, IDS))
        assert Stage.CONSISTENCY_CHECK not in server.seconds or rnd == 1


def test_a_dropout_aborts_the_presigned_round_and_the_next_runs_the_usual_flow():
    run = Run(MALICIOUS)
    run.round(1, presign=True)
    total, server, _, _, _ = run.round(2, presign=True, drop={3: Stage.SHARE_KEYS})
    assert server.config.presign and total is None
    assert server.status is Status.ABORTED
    assert "pre-signed round: 1 of the 7 listed clients" in server.abort_reason
    assert "3: dropped" in server.abort_reason
    assert "no share was requested" in server.abort_reason
    assert server.ahead == {}  # nobody answered an unmask request
    total, server, exchanges, inputs, errors = run.round(3, presign=True)
    assert not server.config.keys_ahead and not server.config.presign
    assert server.status is Status.COMPLETED and errors == {} and exchanges == 4
    np.testing.assert_array_equal(total, _sum(inputs, IDS, IDS))
    _, server, exchanges, _, _ = run.round(4, presign=True)  # then ahead again
    assert server.config.presign and exchanges == 2 and server.status is Status.COMPLETED
    total, server, _, _, _ = run.round(5, presign=True, drop={3: Stage.MASKED_INPUT})
    assert server.config.presign and total is None and 3 not in server.rejected
    assert "3: sent its shares without its masked input" in server.abort_reason
    _, server, exchanges, _, _ = run.round(6, presign=True)
    assert server.status is Status.COMPLETED and exchanges == 4


@pytest.mark.parametrize("change", ["signature", "plain"])
def test_an_invalid_or_missing_presignature_aborts_the_round(change):
    run = Run(MALICIOUS)
    run.round(1, presign=True)

    def tamper(stage, src, dst, payload):
        if src == 3 and msg.read_header(payload).kind is MsgType.PRESIGNED_INPUT:
            data = bytearray(payload)
            if change == "signature":
                data[msg.HEADER.size] ^= 1
                return bytes(data)
            h, shares, masked, _ = msg.decode_presigned_input(payload)
            word = masked.vector.dtype
            head = msg.shares_and_input_head(
                msg.Header(MsgType.SHARES_AND_INPUT, h.run_id, h.round_id, h.client_id),
                shares, masked.vector.size, word)
            return head + masked.vector.tobytes()
        return payload

    total, server, _, _, _ = run.round(2, presign=True, intercept=tamper)
    assert total is None and server.status is Status.ABORTED
    why = ("pre-signature does not verify" if change == "signature"
           else "needs the masked input with the shares and a consistency signature")
    assert why in server.rejected[3]
    assert "3: rejected: " in server.abort_reason and why in server.abort_reason
    _, server, exchanges, _, _ = run.round(3, presign=True)
    assert server.status is Status.COMPLETED and exchanges == 4


def _unmask_parts(r: PresignedRound, c: int):
    """Client c's SHARES_AND_UNMASK from the honest server: (its shares, the request)."""
    _, shares, rest = msg.split_shares(r.outbox[c])
    return shares, msg.decode_unmask_request(rest, signed=True)


def test_a_presigned_client_refuses_another_consistency_check():
    r = PresignedRound(7)
    r.until(Stage.UNMASKING)
    assert r.errors == {} and r.server.stage is Stage.UNMASKING
    cfg = r.config
    for c in (2, 3):
        assert r.clients[c]._signed_set == tuple(IDS)
    shares, _ = _unmask_parts(r, 2)
    h = msg.Header(MsgType.CONSISTENCY_CHECK, cfg.run_id, cfg.round_id, 2)
    other = msg.encode_consistency_check(h, msg.ConsistencyCheck(tuple(IDS[1:])))
    with pytest.raises(ProtocolError, match="pre-signed its survivor set"):
        r.clients[2].handle(msg.with_shares(other, shares))
    with pytest.raises(ProtocolError, match="pre-signed its survivor set"):
        r.clients[2].handle(other)
    h3 = msg.Header(MsgType.FORWARDED_SHARES, cfg.run_id, cfg.round_id, 3)
    with pytest.raises(ProtocolError, match="FORWARDED_SHARES in a pre-signed round"):
        r.clients[3].handle(msg.encode_forwarded_shares(h3, _unmask_parts(r, 3)[0]))
    r.run()  # refused without a change: the honest request still completes the round
    assert r.server.status is Status.COMPLETED
    np.testing.assert_array_equal(r.server.result(), _sum(r.inputs, IDS, IDS))


def test_a_presigned_client_refuses_signatures_on_another_set_or_too_few():
    r = PresignedRound(7)
    r.until(Stage.UNMASKING)
    cfg = r.config
    adverts = {c: msg.decode_advertise_keys(r.sent[(MsgType.ADVERTISE_KEYS, c)])[1]
               for c in IDS}
    q = mal.quorum(len(IDS), cfg.t, 0.05)
    for c, n_sigs, why in ((2, q - 1, f"{q - 1} consistency signatures, {q} needed"),):
        shares, (h, m) = _unmask_parts(r, c)
        fewer = dataclasses.replace(m, signatures=m.signatures[: n_sigs])
        with pytest.raises(ProtocolError, match=why):
            r.clients[c].handle(msg.with_shares(msg.encode_unmask_request(h, fewer, signed=True),
                                                shares))
    # q signatures (forged with every identity the test holds) on S' = the list without 1
    view = tuple(IDS[1:])
    message = mal.consistency_message(cfg.run_id, cfg.round_id, view, r.server.list_digest)
    sigs = tuple(signed_set(w, adverts[w], IDENTITIES[w].sign(message)) for w in view[:q])
    shares, (h, m) = _unmask_parts(r, 4)
    lie = msg.UnmaskRequest(tuple(v for v in view if v != 4), (1,), sigs)
    with pytest.raises(ProtocolError, match="is not on the survivor set this client signed"):
        r.clients[4].handle(msg.with_shares(msg.encode_unmask_request(h, lie, signed=True),
                                            shares))
    # the real quorum on S, but naming 1 dropped
    lie = dataclasses.replace(lie, signatures=m.signatures)
    with pytest.raises(ProtocolError, match="lists as dropped a client of the signed"):
        r.clients[4].handle(msg.with_shares(msg.encode_unmask_request(h, lie, signed=True),
                                            shares))
    r.run()  # each refusal changed nothing
    assert r.server.status is Status.COMPLETED and r.errors == {}


def test_the_dropout_lie_against_a_presigned_round_rebuilds_no_input():
    """The server tells 2 and 3 that client 1 survived and 4 and 5 that it dropped; 6 and 7
    are corrupt (they sign any set and answer everything). The honest clients pre-signed
    the whole list, so the lie to 4 and 5 finds no quorum on the set they signed, and no
    request on that set may name 1 dropped: nobody's input is rebuilt."""
    r = PresignedRound(7, corrupt={6, 7})
    r.until(Stage.UNMASKING)
    cfg, everyone = r.config, tuple(IDS)
    adverts = {c: msg.decode_advertise_keys(r.sent[(MsgType.ADVERTISE_KEYS, c)])[1]
               for c in everyone}
    view = everyone[1:]
    message = mal.consistency_message(cfg.run_id, cfg.round_id, view, r.server.list_digest)
    corrupt_sigs = tuple(signed_set(c, adverts[c], IDENTITIES[c].sign(message)) for c in (6, 7))
    for c in (6, 7):  # the corrupt ones take their own shares and answer honestly
        r.deliver(c, r.outbox[c])
    for w in (2, 3):  # told that 1 survived: the honest request (self-mask shares of 1)
        assert r.deliver(w, r.outbox[w]) is not None
    for w in (4, 5):  # told that 1 dropped, with every signature the server can get on S'
        shares, (h, m) = _unmask_parts(r, w)
        for sigs in (corrupt_sigs, m.signatures, m.signatures + corrupt_sigs):
            lie = msg.UnmaskRequest(tuple(v for v in view if v != w), (1,),
                                    tuple({x.signer.client_id: x for x in sigs}.values()))
            r.errors.pop(w, None)
            r.deliver(w, msg.with_shares(msg.encode_unmask_request(h, lie, signed=True),
                                         shares))
            assert w in r.errors, w
    assert (MsgType.UNMASK_AND_ADVERTISE, 4) not in r.sent
    assert r.rebuild(1) is None
    r.assert_nobody_rebuilt()


def test_presign_needs_the_malicious_mode_and_keys_ahead_and_travels_in_setup():
    from privacy.secagg import SessionParams
    base = SessionParams.create(IDS, 8, run_id=RUN, round_id=2, security=MALICIOUS,
                                keys_ahead=True, advertise_ahead=True)
    signed = dataclasses.replace(base, presign=True)
    plain, pre = msg.encode_setup(base, 1), msg.encode_setup(signed, 1)
    assert plain[:-1] == pre[:-1] and pre[-1] == plain[-1] | 0x80
    assert msg.decode_setup(pre)[1] == signed
    with pytest.raises(ValueError, match="pre-signed survivor set needs"):
        dataclasses.replace(base, security="semi_honest", presign=True)
    with pytest.raises(ValueError, match="pre-signed survivor set needs"):
        dataclasses.replace(base, keys_ahead=False, presign=True)
    semi = SessionParams.create(IDS, 8, run_id=RUN, round_id=2, keys_ahead=True,
                                advertise_ahead=True)
    with pytest.raises(ProtocolError, match="invalid configuration"):
        msg.decode_setup(msg.encode_setup(semi, 1)[:-1] + bytes([msg.encode_setup(semi, 1)[-1]
                                                                  | 0x80]))


def test_the_presigned_set_survives_export_and_import():
    r = PresignedRound(7)
    r.until(Stage.UNMASKING)
    for c in IDS:
        again = SecAggClient.from_state(r.clients[c].export_state(), **_own(c))
        assert again._signed_set == tuple(IDS) and again.stage is Stage.SHARE_KEYS
        assert again.export_state() == r.clients[c].export_state()
        r.clients[c] = again
    shares, _ = _unmask_parts(r, 2)
    h = msg.Header(MsgType.CONSISTENCY_CHECK, r.config.run_id, r.config.round_id, 2)
    other = msg.encode_consistency_check(h, msg.ConsistencyCheck(tuple(IDS[1:])))
    with pytest.raises(ProtocolError, match="pre-signed its survivor set"):
        r.clients[2].handle(msg.with_shares(other, shares))
    r.run()
    assert r.server.status is Status.COMPLETED and r.errors == {}
    np.testing.assert_array_equal(r.server.result(), _sum(r.inputs, IDS, IDS))


def test_the_config_key_defaults_true_and_refuses_a_bad_type():
    assert SecAggScenarioConfig().presign is True
    assert SecAggScenarioConfig(presign=False).presign is False
    with pytest.raises(ValueError, match=r"secagg\.presign must be true or false"):
        SecAggScenarioConfig(presign="yes")
    with pytest.raises(ValueError, match=r"secagg\.presign"):
        SecAggScenarioConfig.from_dict({"presign": 1})
