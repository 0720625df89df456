"""SecAgg+ against a server that lies: the malicious mode's checks, attack by attack.

A lying server is played over the two real state machines: an honest
:class:`SecAggServer` produces the messages, and the test rewrites them before they reach
the clients (and, for the dropout lie, writes its own). After each attack the test tries
what a server would: collect every share it received (and the shares corrupt clients
hold) and rebuild an honest client's input from its masked vector.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np
import pytest

from privacy.secagg import (
    CLASSIC,
    DEFAULT_POLICY,
    MERGED,
    ProtocolError,
    SecAggClient,
    SecAggServer,
    SessionParams,
    Stage,
    Status,
    run_secagg_round,
)
from privacy.secagg import keys as kx
from privacy.secagg import malicious as mal
from privacy.secagg import messages as msg
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.messages import MsgType, ShareKind
from privacy.secagg.prg import combine
from privacy.secagg.shamir import reconstruct_secret


def random_inputs(n: int, dim: int, bits: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << bits, dim, dtype=np.uint64).astype(np.uint32)
            for _ in range(n)]


def plain_sum(inputs: list[np.ndarray], ids: Iterable[int], bits: int) -> np.ndarray:
    """The exact sum mod 2^bits of the inputs of clients ``ids`` (1-based)."""
    return sum(inputs[c - 1].astype(np.uint64) for c in ids) % (1 << bits)

BITS = 32
DIM = 16
MAL = "malicious"
IDENTITIES = {c: Identity.generate() for c in range(1, 13)}
TRUST_ALL = TrustedKeys(i.public for i in IDENTITIES.values())

Tamper = Callable[[int, bytes], bytes | None]


class LyingRound:
    """One round over the real state machines, every server message open to rewriting
    (the classic flow's messages unless ``flow="merged"``).

    ``corrupt`` clients collude with the server: their shares and identities are its own.
    ``sent`` keeps every client reply the server received, by (message type, sender).
    """

    def __init__(self, n: int, *, k: int | None = None, t: int | None = None,
                 security: str = MAL, corrupt: Iterable[int] = (), round_id: int = 0,
                 trusted: TrustedKeys = TRUST_ALL, seed: int = 0,
                 flow: str = CLASSIC) -> None:
        ids = list(range(1, n + 1))
        self.inputs = random_inputs(n, DIM, BITS, seed)
        self.config = SessionParams.create(ids, DIM, k=k, t=t, round_id=round_id,
                                           security=security, flow=flow)
        self.server = SecAggServer(self.config)
        extra: dict[str, object] = {}
        self.clients = {}
        for c in ids:
            if security == MAL:
                extra = {"identity": IDENTITIES[c], "trusted": trusted, "security": MAL}
            self.clients[c] = SecAggClient(c, round_id=round_id, **extra)
            self.clients[c].set_input(self.inputs[c - 1])
        self.corrupt = set(corrupt)
        self.errors: dict[int, str] = {}
        self.sent: dict[tuple[MsgType, int], bytes] = {}
        self.outbox = self.server.start()

    def deliver(self, c: int, payload: bytes) -> bytes | None:
        """Hand ``payload`` to client c; its reply (recorded), or None if it refused."""
        if c in self.errors:
            return None
        try:
            reply = bytes(self.clients[c].handle(payload))
        except ProtocolError as exc:
            self.errors[c] = exc.reason
            return None
        self.sent[(msg.read_header(reply).kind, c)] = reply
        return reply

    def step(self, tamper: Tamper | None = None) -> None:
        """Deliver the open outbox (through ``tamper``), replies to the server, advance."""
        for c, payload in self.outbox.items():
            p = tamper(c, payload) if tamper is not None else payload
            reply = self.deliver(c, p) if p is not None else None
            if reply is not None:
                self.server.receive(c, reply)
        self.outbox = self.server.advance()

    def run(self, tamper: Tamper | None = None) -> None:
        while self.server.status is Status.RUNNING:
            self.step(tamper)

    def until(self, stage: Stage, tamper: Tamper | None = None) -> None:
        """Run until the server's open stage is ``stage`` (its prompts in the outbox)."""
        while self.server.status is Status.RUNNING and self.server.stage is not stage:
            self.step(tamper)

    # --- what the server (and its corrupt clients) can do with what it received ------

    def rebuild(self, u: int) -> np.ndarray | None:
        """Client u's input rebuilt from the received shares and its masked input (of the
        classic stage, or else the one sent with its shares), or None when they do not
        give both of its secrets."""
        got = self.rebuild_all(u)
        return got[0] if got else None

    def rebuild_all(self, u: int) -> list[np.ndarray]:
        """Client u's input rebuilt from each masked input it sent (the merged flow's
        fallback makes two: over its PUBLIC_KEYS neighbours, then over the senders of the
        shares it received), as far as the received shares give both of its secrets."""
        vectors = []
        if (MsgType.MASKED_INPUT, u) in self.sent:
            vectors.append((msg.decode_masked_input(self.sent[(MsgType.MASKED_INPUT, u)])[1]
                            .vector, self.clients[u].held_peers))
        if (MsgType.SHARES_AND_INPUT, u) in self.sent:
            early = self.sent[(MsgType.SHARES_AND_INPUT, u)]
            vectors.append((msg.decode_shares_and_input(early)[2].vector,
                            self.server._told_keys[u]))
        if (MsgType.PRESIGNED_INPUT, u) in self.sent:  # a pre-signed round's
            early = self.sent[(MsgType.PRESIGNED_INPUT, u)]
            vectors.append((msg.decode_presigned_input(early)[2].vector,
                            self.server._told_keys[u]))
        out = []
        for vector, peers in vectors:
            got = self._rebuild(u, vector, peers)
            if got is not None:
                out.append(got)
        return out

    def _rebuild(self, u: int, vector: np.ndarray, peers: Iterable[int]) -> np.ndarray | None:
        cfg = self.config
        advert = self.sent.get((MsgType.ADVERTISE_KEYS, u))
        if advert is None:
            return None
        points: dict[ShareKind, dict[int, bytes]] = {ShareKind.SELF_MASK: {},
                                                     ShareKind.MASK_KEY: {}}
        for (kind, w), payload in self.sent.items():
            if kind is MsgType.UNMASK_RESPONSE:
                for s in msg.decode_unmask_response(payload)[1].shares:
                    if s.peer == u:
                        points[s.kind][cfg.positions[w] + 1] = s.share
        for w in self.corrupt:
            held = self.clients[w]._held.get(u)  # a corrupt client's own
            if held is not None:
                points[ShareKind.SELF_MASK][cfg.positions[w] + 1] = held[0]
                points[ShareKind.MASK_KEY][cfg.positions[w] + 1] = held[1]
        if any(len(p) < cfg.t for p in points.values()):
            return None
        b_seed = reconstruct_secret(list(points[ShareKind.SELF_MASK].items())[: cfg.t])
        sk_raw = reconstruct_secret(list(points[ShareKind.MASK_KEY].items())[: cfg.t])
        keys = msg.decode_advertise_keys(advert)[1]
        sk = kx.private_key_from_bytes(sk_raw)
        if kx.commit(b_seed) != keys.b_commitment or kx.public_bytes(sk) != keys.s_pk:
            return None
        masks = [(b_seed, -1)]
        for v in sorted(peers):
            s_pk = msg.decode_advertise_keys(self.sent[(MsgType.ADVERTISE_KEYS, v)])[1].s_pk
            seed = kx.pair_seed(kx.agree(sk, s_pk), cfg.run_id, cfg.round_id, u, v)
            masks.append((seed, -1 if u < v else 1))
        return combine([vector], masks, cfg.dim, cfg.bits)

    def assert_nobody_rebuilt(self) -> None:
        for u in self.clients:
            if u not in self.corrupt:
                for got in self.rebuild_all(u):
                    assert not np.array_equal(got, self.inputs[u - 1]), u


def signed_keys(payload: bytes) -> tuple[msg.Header, msg.PublicKeys]:
    return msg.decode_public_keys(payload, signed=True)


def public_keys(h: msg.Header, m: msg.PublicKeys) -> bytes:
    return msg.encode_public_keys(h, m, signed=True)


def only(recipients: set[int], kind: MsgType, change: Callable[[int, bytes], bytes]) -> Tamper:
    """Rewrite the ``kind`` messages to ``recipients``, pass everything else."""
    def tamper(c: int, payload: bytes) -> bytes:
        if c in recipients and msg.read_header(payload).kind is kind:
            return change(c, payload)
        return payload
    return tamper


def refused(r: LyingRound, clients: Iterable[int], why: str) -> None:
    for c in clients:
        assert why in r.errors.get(c, ""), (c, r.errors)


# --- honest rounds ---------------------------------------------------------------


@pytest.mark.parametrize("stage", [None, Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS,
                                   Stage.MASKED_INPUT, Stage.CONSISTENCY_CHECK,
                                   Stage.UNMASKING],
                         ids=lambda s: getattr(s, "name", "none"))
def test_honest_malicious_round_decodes_the_exact_sum(stage: Stage | None) -> None:
    inputs = random_inputs(12, DIM, BITS, 1)
    drop = {} if stage is None else {3: stage, 8: stage}
    errors: dict[int, str] = {}
    total, server = run_secagg_round(inputs, bits=BITS, drop=drop, security=MAL,
                                     identities=IDENTITIES, trusted=TRUST_ALL,
                                     client_errors=errors)
    assert errors == {}
    assert total is not None, server.abort_reason
    gone = {3, 8} if stage is not None and stage <= Stage.MASKED_INPUT else set()
    assert server.survivors == set(range(1, 13)) - gone
    np.testing.assert_array_equal(total, plain_sum(inputs, sorted(server.survivors), BITS))


def test_sparse_graph_malicious_round_with_saved_states() -> None:
    """k < n-1, and every client saved and restored between messages."""
    r = LyingRound(12, k=4, t=3)
    own = {c: {"identity": IDENTITIES[c], "trusted": TRUST_ALL, "security": MAL}
           for c in r.clients}
    while r.server.status is Status.RUNNING:
        for c in r.outbox:
            r.clients[c] = SecAggClient.from_state(r.clients[c].export_state(), **own[c])
            r.clients[c].set_input(r.inputs[c - 1])
        r.step()
    assert r.errors == {}
    np.testing.assert_array_equal(r.server.result(), plain_sum(r.inputs, range(1, 13), BITS))
    assert r.server.neighbours != SecAggServer(r.config).neighbours  # not the SETUP seed's


def test_semi_honest_setup_refused_by_a_client_that_requires_malicious() -> None:
    config = SessionParams.create(range(1, 6), DIM)
    strict = SecAggClient(1, identity=IDENTITIES[1], trusted=TRUST_ALL, security=MAL)
    with pytest.raises(ProtocolError, match="asks for semi_honest security; this client "
                                            "requires malicious"):
        strict.handle(msg.encode_setup(config, 1))
    plain = SecAggClient(1)
    with pytest.raises(ProtocolError, match="this client has no identity key"):
        plain.handle(msg.encode_setup(dataclasses.replace(config, security=MAL), 1))


def test_semi_honest_setup_bytes_are_unchanged_and_the_mode_travels() -> None:
    config = SessionParams.create(range(1, 6), DIM, flow=CLASSIC)  # the merged flow adds a bit
    plain = msg.encode_setup(config, 1)
    assert len(plain) == msg.HEADER.size + 4 * 3 + 1 + 8 + 32 + 8 * 5
    signed = msg.encode_setup(dataclasses.replace(config, security=MAL), 1)
    assert signed[:-1] == plain and msg.decode_setup(signed)[1].security == MAL
    with pytest.raises(ProtocolError, match="unknown security mode 2"):
        msg.decode_setup(plain + b"\x02")


# --- attacks -----------------------------------------------------------------------


def dropout_lie(security: str, flow: str = CLASSIC) -> LyingRound:
    """(a) The server tells 2 and 3 that client 1 survived and 4 and 5 that it dropped;
    6 and 7 are corrupt (they answer both requests, and sign any set). In the merged flow
    each lying message carries the recipient's forwarded shares."""
    r = LyingRound(7, security=security, corrupt={6, 7}, flow=flow)
    r.until(Stage.CONSISTENCY_CHECK if security == MAL else Stage.UNMASKING)
    cfg, everyone = r.config, tuple(range(1, 8))
    shares = {w: msg.split_shares(p)[1] for w, p in r.outbox.items()} if flow == MERGED \
        else {}

    def carry(w: int, payload: bytes) -> bytes:  # the shares go with the first message
        return msg.with_shares(payload, shares.pop(w)) if w in shares else payload

    for c in sorted(r.corrupt & shares.keys()):  # the corrupt ones take their own shares
        r.deliver(c, r.outbox[c])
        shares.pop(c)
    views = {w: everyone for w in (1, 2, 3)} | {w: everyone[1:] for w in (4, 5)}
    signatures: dict[tuple[int, ...], list[msg.SignedSet]] = {everyone: [], everyone[1:]: []}
    if security == MAL:
        adverts = {c: msg.decode_advertise_keys(r.sent[(MsgType.ADVERTISE_KEYS, c)])[1]
                   for c in everyone}
        for w, view in views.items():  # the honest clients sign what they are shown
            h = msg.Header(MsgType.CONSISTENCY_CHECK, cfg.run_id, cfg.round_id, w)
            reply = r.deliver(w, carry(w, msg.encode_consistency_check(
                h, msg.ConsistencyCheck(view))))
            assert reply is not None
            signatures[view].append(signed_set(w, adverts[w],
                                               msg.decode_consistency_signature(reply)[1]))
        for view, sigs in signatures.items():  # the corrupt ones sign both sets
            message = mal.consistency_message(cfg.run_id, cfg.round_id, view,
                                              r.server.list_digest)
            sigs += [signed_set(c, adverts[c], IDENTITIES[c].sign(message)) for c in (6, 7)]
    for w in (2, 3, 4, 5):
        view = views[w]
        h = msg.Header(MsgType.UNMASK_REQUEST, cfg.run_id, cfg.round_id, w)
        req = msg.UnmaskRequest(tuple(v for v in view if v != w),
                                tuple(sorted(set(everyone) - set(view) - {w})),
                                tuple(signatures[view]))
        r.deliver(w, carry(w, msg.encode_unmask_request(h, req, signed=security == MAL)))
    return r


def signed_set(c: int, a: msg.AdvertiseKeys, signature: bytes) -> msg.SignedSet:
    peer = msg.PeerKeys(c, a.c_pk, a.s_pk, a.b_commitment, a.identity, a.signature)
    return msg.SignedSet(peer, signature)


def test_dropout_lie_rebuilds_the_input_in_semi_honest_mode() -> None:
    r = dropout_lie("semi_honest")
    assert r.errors == {}
    np.testing.assert_array_equal(r.rebuild(1), r.inputs[0])


def test_dropout_lie_is_refused_in_malicious_mode() -> None:
    r = dropout_lie(MAL)
    refused(r, (4, 5), "4 consistency signatures, 5 needed")
    assert r.rebuild(1) is None
    r.assert_nobody_rebuilt()


def test_dropout_lie_in_the_merged_flow() -> None:
    """The same lie with the shares carried by the lying messages: it rebuilds client 1's
    input (from the masked input sent with its shares) in the semi-honest mode, and is
    refused in the malicious mode."""
    r = dropout_lie("semi_honest", MERGED)
    assert r.errors == {} and (MsgType.MASKED_INPUT, 1) not in r.sent
    np.testing.assert_array_equal(r.rebuild(1), r.inputs[0])
    r = dropout_lie(MAL, MERGED)
    refused(r, (4, 5), "4 consistency signatures, 5 needed")
    r.assert_nobody_rebuilt()


def test_substituted_public_key_is_refused() -> None:
    """(b) Client 1's encryption key replaced in the PUBLIC_KEYS of all its neighbours."""
    fake = kx.public_bytes(kx.new_private_key())

    def swap(c: int, payload: bytes) -> bytes:
        h, m = signed_keys(payload)
        entries = tuple(dataclasses.replace(e, c_pk=fake) if e.client_id == 1 else e
                        for e in m.entries)
        return public_keys(h, dataclasses.replace(m, entries=entries))

    r = LyingRound(7)
    r.run(only(set(range(2, 8)), MsgType.PUBLIC_KEYS, swap))
    refused(r, range(2, 8), "client 1's advertisement: bad signature")
    assert r.server.status is Status.ABORTED
    r.assert_nobody_rebuilt()


def test_replayed_advertisement_of_a_previous_round_is_refused() -> None:
    """(c) Round 1's signed advertisement of client 1 shown in round 2 (with its list entry
    made to match), and round 1's PUBLIC_KEYS replayed whole."""
    old = LyingRound(7, round_id=1)
    old.until(Stage.SHARE_KEYS)
    old_keys = dict(old.outbox)
    old_advert = next(e for e in signed_keys(old_keys[2])[1].entries if e.client_id == 1)

    def replay(c: int, payload: bytes) -> bytes:
        if c == 7:
            return old_keys[7]
        h, m = signed_keys(payload)
        entries = tuple(old_advert if e.client_id == 1 else e for e in m.entries)
        return public_keys(h, dataclasses.replace(m, entries=entries))

    r = LyingRound(7, round_id=2)
    r.run(only(set(range(2, 8)), MsgType.PUBLIC_KEYS, replay))
    refused(r, range(2, 7), "bound to another run, round or stage: a replay")
    refused(r, [7], "message from run 0 round 1, this session is run 0 round 2")
    r.assert_nobody_rebuilt()


def test_graph_not_derived_from_the_list_is_refused() -> None:
    """(d) A neighbour added (with its genuine signed advertisement) or one left out."""
    r = LyingRound(12, k=4, t=3)
    r.until(Stage.SHARE_KEYS)
    _, m = signed_keys(r.outbox[1])
    mine = {e.client_id for e in m.entries}
    stranger = next(c for c in range(2, 13) if c not in mine)
    advert = next(e for w in r.outbox for e in signed_keys(r.outbox[w])[1].entries
                  if e.client_id == stranger)
    victim = min(mine)

    def change(c: int, payload: bytes) -> bytes:
        h, m = signed_keys(payload)
        if c == 1:
            entries = (*m.entries, advert)
        else:
            entries = tuple(e for e in m.entries if e.client_id != 1)
        return public_keys(h, dataclasses.replace(m, entries=entries))

    r.run(only({1, victim}, MsgType.PUBLIC_KEYS, change))
    refused(r, [1], f"neighbours are not the graph derived from the advertisement list "
                    f"(extra [{stranger}], missing [])")
    refused(r, [victim], "(extra [], missing [1])")
    r.assert_nobody_rebuilt()


def test_server_graph_from_its_own_seed_is_refused() -> None:
    """(d) A server that builds the graph from the SETUP seed it chose, as in the
    semi-honest mode, is refused by every client whose neighbours differ."""
    r = LyingRound(12, k=4, t=3)
    r.until(Stage.SHARE_KEYS)
    chosen = SecAggServer(r.config).neighbours
    adverts = {e.client_id: e for w in r.outbox for e in signed_keys(r.outbox[w])[1].entries}

    def own_graph(c: int, payload: bytes) -> bytes:
        h, m = signed_keys(payload)
        entries = tuple(adverts[v] for v in sorted(chosen[c]))
        return public_keys(h, dataclasses.replace(m, entries=entries))

    r.run(only(set(r.clients), MsgType.PUBLIC_KEYS, own_graph))
    differ = [c for c in r.clients if chosen[c] != r.server.neighbours[c]]
    assert differ
    refused(r, differ, "neighbours are not the graph derived from the advertisement list")
    r.assert_nobody_rebuilt()


def resign(r: LyingRound, change: Callable[[list[msg.SignedSet]], list[msg.SignedSet]],
           targets: set[int]) -> Tamper:
    def tamper(c: int, payload: bytes) -> bytes:
        h, m = msg.decode_unmask_request(payload, signed=True)
        return msg.encode_unmask_request(
            h, dataclasses.replace(m, signatures=tuple(change(list(m.signatures)))),
            signed=True)
    return only(targets, MsgType.UNMASK_REQUEST, tamper)


def test_too_few_signatures_are_refused() -> None:
    """(e) The request forwards t signatures, fewer than the quorum."""
    r = LyingRound(7)
    r.run(resign(r, lambda sigs: sigs[: r.config.t], set(r.clients)))
    refused(r, r.clients, f"{r.config.t} consistency signatures, 5 needed")
    assert r.server.status is Status.ABORTED
    r.assert_nobody_rebuilt()


def test_signatures_on_another_set_are_refused() -> None:
    """(e) Signatures of the members on a set without client 1 (corrupt 4, 5 sign it)."""
    r = LyingRound(7, corrupt={4, 5})
    r.until(Stage.CONSISTENCY_CHECK)
    cfg = r.config
    other = mal.consistency_message(cfg.run_id, cfg.round_id, range(2, 8), r.server.list_digest)

    def forged(sigs: list[msg.SignedSet]) -> list[msg.SignedSet]:
        return [dataclasses.replace(x, signature=IDENTITIES[x.signer.client_id].sign(other))
                if x.signer.client_id in (4, 5) else x for x in sigs]

    r.run(resign(r, forged, {1, 2, 3, 6, 7}))
    refused(r, (1, 2, 3, 6, 7), "client 4's signature is not on the survivor set this "
                                "client signed")
    r.assert_nobody_rebuilt()


def test_signature_from_outside_the_survivor_set_is_refused() -> None:
    """(e) S leaves out corrupt client 7, whose signature makes up the quorum."""
    r = LyingRound(7, corrupt={7})
    r.until(Stage.CONSISTENCY_CHECK)
    cfg, view = r.config, tuple(range(1, 7))
    adverts = {c: msg.decode_advertise_keys(r.sent[(MsgType.ADVERTISE_KEYS, c)])[1]
               for c in range(1, 8)}
    sigs = []
    for w in (1, 2, 3, 4):
        h = msg.Header(MsgType.CONSISTENCY_CHECK, cfg.run_id, cfg.round_id, w)
        reply = r.deliver(w, msg.encode_consistency_check(h, msg.ConsistencyCheck(view)))
        sigs.append(signed_set(w, adverts[w], msg.decode_consistency_signature(reply)[1]))
    message = mal.consistency_message(cfg.run_id, cfg.round_id, view, r.server.list_digest)
    sigs.append(signed_set(7, adverts[7], IDENTITIES[7].sign(message)))
    for w in (1, 2, 3, 4):
        h = msg.Header(MsgType.UNMASK_REQUEST, cfg.run_id, cfg.round_id, w)
        req = msg.UnmaskRequest(tuple(v for v in view if v != w), (), tuple(sigs))
        r.deliver(w, msg.encode_unmask_request(h, req, signed=True))
    refused(r, (1, 2, 3, 4), "signer 7 is not in the signed survivor set")
    r.assert_nobody_rebuilt()


def test_request_against_the_signed_set_is_refused() -> None:
    """A valid quorum on S, but a request that calls a member of S dropped."""
    r = LyingRound(7)
    r.until(Stage.UNMASKING)

    def lie(c: int, payload: bytes) -> bytes:
        h, m = msg.decode_unmask_request(payload, signed=True)
        victim = m.survivors[0]
        req = dataclasses.replace(m, survivors=m.survivors[1:], dropped=(victim,))
        return msg.encode_unmask_request(h, req, signed=True)

    r.run(only({2}, MsgType.UNMASK_REQUEST, lie))
    refused(r, [2], "lists as dropped a client of the signed survivor set")


def test_untrusted_identity_is_refused() -> None:
    """Client 3's identity is not in the others' trusted set."""
    others = TrustedKeys(IDENTITIES[c].public for c in range(1, 8) if c != 3)
    r = LyingRound(7, trusted=others)
    r.run()
    refused(r, [c for c in range(1, 8) if c != 3], "client 3's advertisement: identity "
                                                   "not trusted")
    r.assert_nobody_rebuilt()
    # a server given the trusted set leaves client 3 out, and the round completes
    inputs = random_inputs(7, DIM, BITS, 2)
    total, server = run_secagg_round(inputs, security=MAL, identities=IDENTITIES,
                                     trusted=others, server_trusted=others)
    assert server.rejected[3] == "advertisement refused: untrusted identity"
    np.testing.assert_array_equal(total, plain_sum(inputs, [1, 2, 4, 5, 6, 7], BITS))


def test_identity_used_by_two_nodes_is_refused() -> None:
    """Client 2's advertisement re-signed by client 1's identity: client 1 sees its own
    identity, client 3 sees it twice."""
    r = LyingRound(7)
    r.until(Stage.SHARE_KEYS)
    cfg = r.config

    def reuse(c: int, payload: bytes) -> bytes:
        h, m = signed_keys(payload)
        entries = []
        for e in m.entries:
            if e.client_id == 2:
                message = mal.advert_message(cfg.run_id, cfg.round_id, 2, e.c_pk, e.s_pk,
                                             e.b_commitment, IDENTITIES[1].public)
                e = dataclasses.replace(e, identity=IDENTITIES[1].public,
                                        signature=IDENTITIES[1].sign(message))
            entries.append(e)
        return public_keys(h, dataclasses.replace(m, entries=tuple(entries)))

    r.run(only({1, 3}, MsgType.PUBLIC_KEYS, reuse))
    refused(r, [1, 3], "client 2's advertisement: identity already used by client 1")


def test_quorum_needs_more_than_half_the_list() -> None:
    assert mal.quorum(7, 4, 0.05) == 5
    assert mal.quorum(100, 18, 0.05) == 53
    assert mal.quorum(4, 4, 0.0) == 4


def test_policy_of_the_server_is_unchanged_for_semi_honest() -> None:
    assert DEFAULT_POLICY.violation(SessionParams.create(range(1, 8), DIM)) is None


def test_malicious_decoders_refuse_mangled_messages_with_protocol_errors() -> None:
    """Every malicious-mode message cut short, extended or flipped: a ProtocolError or a
    decoded message, nothing else."""
    r = LyingRound(7)
    samples: dict[MsgType, bytes] = {}
    while r.server.status is Status.RUNNING:
        for payload in r.outbox.values():
            samples.setdefault(msg.read_header(payload).kind, payload)
        r.step()
    samples.update({kind: p for (kind, _), p in r.sent.items()})
    decoders = {MsgType.PUBLIC_KEYS: lambda d: msg.decode_public_keys(d, signed=True),
                MsgType.UNMASK_REQUEST: lambda d: msg.decode_unmask_request(d, signed=True)}
    rng = np.random.default_rng(0)
    assert {MsgType.CONSISTENCY_CHECK, MsgType.CONSISTENCY_SIGNATURE} <= samples.keys()
    for kind, data in samples.items():
        decode = decoders.get(kind, msg.DECODERS[kind])
        decode(data)
        for _ in range(40):
            bad = bytearray(data)
            choice = rng.integers(3)
            if choice == 0:
                bad = bad[: rng.integers(len(bad))]
            elif choice == 1:
                bad += bytes(rng.integers(1, 9))
            else:
                bad[rng.integers(len(bad))] ^= 1 << int(rng.integers(8))
            with contextlib.suppress(ProtocolError):
                decode(bytes(bad))


@pytest.mark.parametrize("security", ["semi_honest", MAL])
def test_fallback_masked_inputs_rebuild_no_input(security: str) -> None:
    """Client 6 is sent no PUBLIC_KEYS, so it sends no shares and the server falls back:
    it holds two masked inputs of every other client (over U1, then over U2), and corrupt
    7 and 8 add their own shares. No honest client's input is rebuilt from either."""
    r = LyingRound(8, security=security, corrupt={7, 8}, flow=MERGED)
    r.run(only({6}, MsgType.PUBLIC_KEYS, lambda c, p: None))
    assert r.server.status is Status.COMPLETED and not r.server.merged
    twice = {u for u in range(1, 9) if (MsgType.SHARES_AND_INPUT, u) in r.sent
             and (MsgType.MASKED_INPUT, u) in r.sent}
    assert twice == {1, 2, 3, 4, 5, 7, 8}
    np.testing.assert_array_equal(r.server.result(), plain_sum(r.inputs, sorted(twice), BITS))
    r.assert_nobody_rebuilt()
