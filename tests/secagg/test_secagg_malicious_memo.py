"""The malicious mode's shortcuts keep every check: the memo of signature blocks that passed,
the server verifying only the consistency signatures it forwards, a client's own
advertisement digest kept in its saved state, and the encodings made once per stage."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from privacy.secagg import (
    CLASSIC,
    ProtocolError,
    SecAggClient,
    SessionParams,
    Stage,
    Status,
)
from privacy.secagg import malicious as mal
from privacy.secagg import messages as msg
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.messages import MsgType
from privacy.secagg.server import SecAggServer

N, DIM, BITS = 12, 16, 32
IDENTITIES = {c: Identity.generate() for c in range(1, N + 1)}
TRUST_ALL = TrustedKeys(i.public for i in IDENTITIES.values())
Rewrite = Callable[[int, bytes], bytes]  # (client, message) -> the message delivered


def inputs(n: int = N) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 1 << BITS, DIM, dtype=np.uint64).astype(np.uint32)
            for _ in range(n)]


class Round:
    """Honest server and clients; replies and server messages can be rewritten."""

    def __init__(self, trusted: dict[int, TrustedKeys] | None = None,
                 save: bool = False, k: int | None = None, t: int | None = None) -> None:
        ids = list(range(1, N + 1))
        self.inputs = inputs()
        self.config = SessionParams.create(ids, DIM, k=k, t=t, security="malicious",
                                           flow=CLASSIC)  # rewrites the classic messages
        self.server = SecAggServer(self.config)
        self.trusted = {c: (trusted or {}).get(c, TRUST_ALL) for c in ids}
        self.clients = {c: self._client(c) for c in ids}
        self.errors: dict[int, str] = {}
        self.save = save
        self.outbox = self.server.start()

    def _client(self, c: int) -> SecAggClient:
        client = SecAggClient(c, identity=IDENTITIES[c], trusted=self.trusted[c],
                              security="malicious")
        client.set_input(self.inputs[c - 1])
        return client

    def step(self, to_client: Rewrite | None = None, to_server: Rewrite | None = None) -> None:
        for c, payload in self.outbox.items():
            if c in self.errors:
                continue
            if to_client is not None:
                payload = to_client(c, payload)
            client = self.clients[c]
            if self.save:  # a fresh process per message
                client = SecAggClient.from_state(client.export_state(),
                                                 identity=IDENTITIES[c],
                                                 trusted=self.trusted[c],
                                                 security="malicious")
                client.set_input(self.inputs[c - 1])
                self.clients[c] = client
            try:
                reply = bytes(client.handle(payload))
            except ProtocolError as exc:
                self.errors[c] = exc.reason
                continue
            if to_server is not None:
                reply = to_server(c, reply)
            self.server.receive(c, reply)
        self.outbox = self.server.advance()

    def run(self, to_client: Rewrite | None = None, to_server: Rewrite | None = None) -> None:
        while self.server.status is Status.RUNNING:
            self.step(to_client, to_server)

    def total(self, ids: list[int]) -> np.ndarray:
        return sum(self.inputs[c - 1].astype(np.uint64) for c in ids) % (1 << BITS)


@pytest.fixture(autouse=True)
def _fresh_memos() -> None:
    mal.forget()


def test_the_server_rejects_a_bad_consistency_signature_and_forwards_only_valid_ones() -> None:
    """Client 1's signature (the first the server verifies) is garbage: the server rejects
    it and forwards the next valid ones, so the honest clients unmask and the round
    completes with everybody's input in the sum."""
    r = Round()

    def bad_signature(c: int, reply: bytes) -> bytes:
        if c == 1 and msg.read_header(reply).kind is MsgType.CONSISTENCY_SIGNATURE:
            return reply[:-64] + bytes(64)
        return reply

    r.run(to_server=bad_signature)
    assert r.errors == {}
    assert r.server.status is Status.COMPLETED, r.server.abort_reason
    assert r.server.rejected == {1: "consistency signature does not verify"}
    np.testing.assert_array_equal(r.server.result(), r.total(list(range(1, N + 1))))


def test_too_many_bad_consistency_signatures_abort_before_any_share_is_asked() -> None:
    r = Round()
    quorum = mal.quorum(N, r.config.t, 0.05)
    bad = set(range(1, N - quorum + 2))  # one more than the quorum can spare

    def bad_signature(c: int, reply: bytes) -> bytes:
        if c in bad and msg.read_header(reply).kind is MsgType.CONSISTENCY_SIGNATURE:
            return reply[:-64] + bytes(64)
        return reply

    r.run(to_server=bad_signature)
    assert r.server.status is Status.ABORTED
    assert f"{N - len(bad)} consistency signatures, {quorum} needed" in r.server.abort_reason
    assert Stage.UNMASKING not in r.server.dropouts


def _swap_last_signature(block: bytes) -> bytes:
    """The block with its last consistency signature replaced by the first one's."""
    sets = list(msg.decode_signed_sets(block))
    sets[-1] = msg.SignedSet(sets[-1].signer, sets[0].signature)
    return msg.encode_signed_sets(tuple(sets))


def _with_block(payload: bytes, change: Callable[[bytes], bytes]) -> bytes:
    h, m, block = msg.decode_unmask_head(payload, signed=True)
    return msg.encode_unmask_request(h, m, signed=True, block=change(block))


def test_a_tampered_block_is_refused_after_others_passed() -> None:
    """The first clients check the honest block (and remember it); the last one is sent a
    block with one signature swapped, and refuses it."""
    r = Round()
    last = max(r.clients)

    def tamper(c: int, payload: bytes) -> bytes:
        if c == last and msg.read_header(payload).kind is MsgType.UNMASK_REQUEST:
            return _with_block(payload, _swap_last_signature)
        return payload

    r.run(to_client=tamper)
    assert set(r.errors) == {last}
    assert "is not on the survivor set this client signed" in r.errors[last]


def test_a_remembered_block_is_checked_again_under_other_trusted_keys() -> None:
    """A client that does not trust signer 1 (not its neighbour, so only its signature
    reaches it) refuses the block that clients before it passed and remembered."""
    r = Round(k=4, t=3)
    while r.server.stage is not Stage.UNMASKING:
        r.step()
    assert r.server.status is Status.RUNNING and 1 in {s.signer.client_id for s in
                                                     msg.decode_unmask_request(
                                                         r.outbox[2], signed=True)[1].signatures}
    victim = max(c for c in r.outbox if c != 1 and 1 not in r.clients[c].neighbours)
    r.clients[victim].trusted = TrustedKeys(IDENTITIES[c].public for c in range(2, N + 1))
    r.run()
    assert set(r.errors) == {victim}
    assert r.errors[victim] == "client 1's advertisement: identity not trusted"


def test_a_remembered_block_is_checked_again_for_another_signed_set() -> None:
    """The last client is asked to sign a smaller survivor set than the others: the
    block of signatures on the others' set, remembered, is refused by it."""
    r = Round()
    last = N

    def split(c: int, payload: bytes) -> bytes:
        if c == last and msg.read_header(payload).kind is MsgType.CONSISTENCY_CHECK:
            h, m = msg.decode_consistency_check(payload)
            return msg.encode_consistency_check(h, msg.ConsistencyCheck(m.survivors[1:]))
        return payload

    r.run(to_client=split)
    assert last in r.errors
    assert "signer 1 is not in the signed survivor set" in r.errors[last]


def test_saved_sessions_keep_their_own_advertisement_digest() -> None:
    """Every client saved and restored between messages: the list is checked against the
    digest kept in the state, and a list lacking the client's own entry is refused."""
    r = Round(save=True)
    r.run()
    assert r.errors == {}
    np.testing.assert_array_equal(r.server.result(), r.total(list(range(1, N + 1))))

    r = Round(save=True)

    def other_digest(c: int, payload: bytes) -> bytes:
        if c == 2 and msg.read_header(payload).kind is MsgType.PUBLIC_KEYS:
            h, m = msg.decode_public_keys(payload, signed=True)
            listed = tuple((v, bytes(32) if v == 2 else d) for v, d in m.advertised)
            return msg.encode_public_keys(h, msg.PublicKeys(m.entries, listed), signed=True)
        return payload

    r.run(to_client=other_digest)
    assert r.errors.get(2) == "advertisement list lacks this client's own advertisement"


def test_the_encodings_made_once_are_the_per_recipient_ones() -> None:
    h = msg.Header(MsgType.PUBLIC_KEYS, 1, 2, 3)
    listed = ((1, bytes(32)), (5, b"\x01" * 32))
    m = msg.PublicKeys((), listed)
    assert msg.encode_public_keys(h, m, signed=True, listed=msg.encode_list(listed)) == \
        msg.encode_public_keys(h, m, signed=True)
    check = msg.ConsistencyCheck((1, 4, 9))
    h = msg.Header(MsgType.CONSISTENCY_CHECK, 1, 2, 3)
    assert msg.encode_consistency_check(h, check, body=msg.consistency_check_body(check)) == \
        msg.encode_consistency_check(h, check)
    assert msg.decode_consistency_check(msg.encode_consistency_check(h, check))[1] == check
