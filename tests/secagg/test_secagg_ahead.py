"""Keys advertised a round ahead: each client's last reply of round r advertises its keys
for round r+1, and a round whose whole cohort did so sends SETUP with PUBLIC_KEYS (one
exchange fewer). The rules each client enforces, the fallbacks, and a lying server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import test_secagg_malicious as tsm
from test_secagg_malicious import IDENTITIES, TRUST_ALL, LyingRound, only, refused

from privacy.secagg import (
    MALICIOUS,
    MERGED,
    SEMI_HONEST,
    ProtocolError,
    SecAggClient,
    SecAggServer,
    SessionParams,
    Stage,
    Status,
    run_secagg_round,
)
from privacy.secagg import keys as kx
from privacy.secagg import messages as msg
from privacy.secagg.ahead import PendingAdverts
from privacy.secagg.messages import MsgType

N, DIM, RUN = 7, 24, 11
IDS = list(range(1, N + 1))
MODES = [SEMI_HONEST, MALICIOUS]
EXCHANGES = {SEMI_HONEST: 3, MALICIOUS: 4}  # the flow without keys advertised ahead


def _inputs(rnd: int, ids=IDS) -> list[np.ndarray]:
    rng = np.random.default_rng(rnd)
    return [rng.integers(0, 1 << 32, DIM, dtype=np.uint64).astype(np.uint32) for _ in ids]


def _sum(inputs, ids, keep) -> np.ndarray:
    return (sum(x.astype(np.uint64) for c, x in zip(ids, inputs, strict=True) if c in keep)
            % (1 << 32)).astype(np.uint32)


class Run:
    """Rounds of one protocol run over the in-process driver, clients carried over."""

    def __init__(self, security: str) -> None:
        self.security = security
        self.pending = PendingAdverts()
        self.clients: dict[int, SecAggClient] = {}

    def round(self, rnd: int, ids=IDS, **kw):
        inputs = _inputs(rnd, ids)
        extra = ({"identities": IDENTITIES, "trusted": TRUST_ALL}
                 if self.security == MALICIOUS else {})
        exchanges: list[int] = []
        clients: dict[int, SecAggClient] = {}
        errors: dict[int, str] = {}
        total, server = run_secagg_round(
            inputs, ids=ids, k=4, t=3, run_id=RUN, round_id=rnd, security=self.security,
            pending=self.pending, previous=self.clients, exchanges=exchanges,
            clients_out=clients, client_errors=errors, **extra, **kw)
        self.clients = {**self.clients, **clients}
        return total, server, exchanges[0], inputs, errors


@pytest.mark.parametrize("security", MODES)
def test_rounds_with_keys_advertised_ahead_are_exact_with_one_exchange_fewer(security):
    run = Run(security)
    for rnd in range(1, 5):
        total, server, exchanges, inputs, errors = run.round(rnd)
        assert server.status is Status.COMPLETED, server.abort_reason
        assert errors == {}
        np.testing.assert_array_equal(total, _sum(inputs, IDS, IDS))
        ahead = rnd > 1  # round 1 runs the flow without them
        assert server.config.keys_ahead is ahead
        assert exchanges == EXCHANGES[security] - ahead
        assert set(server.ahead) == set(IDS)  # every client advertised for the next round
        assert all(c.advertised_ahead == (RUN, rnd + 1) for c in run.clients.values())


@pytest.mark.parametrize("security", MODES)
def test_a_cohort_change_falls_back_then_goes_ahead_again(security):
    run = Run(security)
    run.round(1, IDS[:-1])  # client 7 advertised nothing
    total, server, exchanges, inputs, _ = run.round(2, IDS)
    assert not server.config.keys_ahead and exchanges == EXCHANGES[security]
    np.testing.assert_array_equal(total, _sum(inputs, IDS, IDS))
    total, server, exchanges, inputs, _ = run.round(3, IDS[1:])  # client 1 left: still ahead
    assert server.config.keys_ahead and exchanges == EXCHANGES[security] - 1
    np.testing.assert_array_equal(total, _sum(inputs, IDS[1:], IDS[1:]))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("stage", [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING])
def test_a_dropout_in_the_ahead_round_is_handled_as_without_it(security, stage):
    run = Run(security)
    run.round(1)
    total, server, _, inputs, _ = run.round(2, drop={3: stage})
    assert server.config.keys_ahead
    assert server.status is Status.COMPLETED, server.abort_reason
    survivors = set(IDS) - ({3} if stage < Stage.UNMASKING else set())
    assert server.survivors == survivors
    assert server.merged is (stage != Stage.SHARE_KEYS)  # no shares from 3: the fallback
    np.testing.assert_array_equal(total, _sum(inputs, IDS, survivors))
    if stage < Stage.UNMASKING:  # it advertised nothing for round 3: the others fall back
        _, server, exchanges, inputs, _ = run.round(3)
        assert not server.config.keys_ahead and exchanges == EXCHANGES[security]
        assert server.status is Status.COMPLETED


def _ahead_setup(client: int, config: SessionParams, adverts: dict[int, bytes]) -> bytes:
    """The SETUP_AND_KEYS an honest server would send ``client`` for ``config``."""
    server = SecAggServer(config, ahead=adverts)
    return server.start()[client]


@pytest.mark.parametrize("security", MODES)
def test_keys_advertised_for_round_r_plus_1_are_refused_in_round_r_plus_2(security):
    run = Run(security)
    run.round(1)  # advertised for round 2; round 2 never runs
    adverts = {c: a for c, (_, _, a) in run.pending._by_node.items()}
    assert run.pending.take(RUN, 3, IDS) is None  # the server does not take them for 3
    assert len(run.pending) == 0  # and drops them
    config = SessionParams.create(IDS, DIM, k=4, t=3, run_id=RUN, round_id=3,
                                  security=security, keys_ahead=True, advertise_ahead=True)
    server = SecAggServer(config, ahead=adverts)  # a server that replays them anyway
    server.start()
    assert server.status is Status.ABORTED
    assert all("replayed or misdirected" in server.rejected[c] for c in IDS)
    # the same advertisements, re-headed for round 3 (a server's lie): the clients refuse
    forged = {c: msg.encode_advertise_keys(msg.Header(MsgType.ADVERTISE_KEYS, RUN, 3, c),
                                           msg.decode_advertise_keys(a)[1])
              for c, a in adverts.items()}
    if security == MALICIOUS:  # the signatures bind round 2: the server refuses them too
        assert SecAggServer(config, ahead=forged).start() == {}
        config = dataclasses.replace(config, security=SEMI_HONEST)
        forged = {c: msg.encode_advertise_keys(
            msg.Header(MsgType.ADVERTISE_KEYS, RUN, 3, c),
            dataclasses.replace(msg.decode_advertise_keys(a)[1], identity=b"", signature=b""))
            for c, a in forged.items()}
    payload = _ahead_setup(1, config, forged)
    client = SecAggClient(1, round_id=3)
    client.inherit(run.clients[1].carry_over())
    client.set_input(_inputs(3)[0])
    with pytest.raises(ProtocolError, match="holds none for it"):
        client.handle(payload)
    assert client.stage is Stage.SETUP


def _carried(security: str) -> tuple[Run, SessionParams, dict[int, bytes]]:
    """A run after round 1, and round 2's configuration with keys advertised ahead."""
    run = Run(security)
    run.round(1)
    adverts = run.pending.take(RUN, 2, IDS)
    assert adverts is not None
    config = SessionParams.create(IDS, DIM, k=4, t=3, run_id=RUN, round_id=2,
                                  security=security, keys_ahead=True, advertise_ahead=True)
    return run, config, adverts


def _session(run: Run, c: int, previous: SecAggClient | None = None) -> SecAggClient:
    """Node c's session for round 2 as a deployed node builds it: a fresh client that
    inherits what its last session carried over (through its exported state)."""
    extra = ({"identity": IDENTITIES[c], "trusted": TRUST_ALL, "security": MALICIOUS}
             if run.security == MALICIOUS else {})
    before = (previous or run.clients[c]).carry_over().export_state()
    session = SecAggClient(c, run_id=RUN, round_id=2, **extra)
    session.inherit(SecAggClient.from_state(before, **extra))
    session.set_input(_inputs(2)[c - 1])
    return session


@pytest.mark.parametrize("security", MODES)
def test_a_client_runs_one_session_per_round_in_either_order(security):
    run, config, adverts = _carried(security)
    fresh = dataclasses.replace(config, keys_ahead=False)
    ahead_setup = _ahead_setup(1, config, adverts)
    # ahead keys used, then a fresh SETUP for the same round: refused
    used = _session(run, 1)
    used.handle(ahead_setup)
    again = _session(run, 1, used)
    with pytest.raises(ProtocolError, match="already ran with the keys advertised ahead"):
        again.handle(msg.encode_setup(fresh, 1))
    later = dataclasses.replace(fresh, round_id=3)  # the next round is not affected
    nxt = SecAggClient(1, **({"identity": IDENTITIES[1], "trusted": TRUST_ALL}
                             if security == MALICIOUS else {}))
    nxt.inherit(again.carry_over())
    nxt.handle(msg.encode_setup(later, 1))
    # a fresh SETUP answered, then the ahead keys: refused (discarded)
    answered = _session(run, 1)
    answered.handle(msg.encode_setup(fresh, 1))
    assert answered.advertised_ahead is None
    with pytest.raises(ProtocolError, match="holds none for it"):
        _session(run, 1, answered).handle(ahead_setup)
    # and the same object refuses a second SETUP of either kind (today's refusal)
    with pytest.raises(ProtocolError, match="SETUP not expected after stage ADVERTISE_KEYS"):
        answered.handle(msg.encode_setup(fresh, 1))
    with pytest.raises(ProtocolError, match="SETUP not expected after stage SHARE_KEYS"):
        used.handle(msg.unbundle(ahead_setup)[1])


def test_a_public_keys_naming_discarded_ahead_keys_is_refused():
    """Malicious mode: after a fresh SETUP, the list holding the client's ahead
    advertisement (not the fresh one) is not its own."""
    run, config, adverts = _carried(MALICIOUS)
    ahead_keys = msg.unbundle(_ahead_setup(1, config, adverts))[2]
    client = _session(run, 1)
    client.handle(msg.encode_setup(dataclasses.replace(config, keys_ahead=False), 1))
    with pytest.raises(ProtocolError, match="lacks this client's own advertisement"):
        client.handle(ahead_keys)


def _rebundled(change):
    """A tamper on SETUP_AND_KEYS messages: ``change`` rewrites their signed PUBLIC_KEYS."""
    def tamper(c: int, payload: bytes) -> bytes:
        _, setup, keys = msg.unbundle(payload)
        h, m = msg.decode_public_keys(keys, signed=True)
        return msg.bundle(MsgType.SETUP_AND_KEYS, setup,
                          msg.encode_public_keys(h, change(c, m), signed=True))
    return tamper


class AheadLyingRound(LyingRound):
    """Round 2 of a run whose round 1 advertised every client's keys ahead: the session
    takes them (SETUP_AND_KEYS), and what the server received of them counts as the
    clients' advertisements (``sent``)."""

    def __init__(self, n: int, *, security: str = tsm.MAL, corrupt=(), flow: str = MERGED,
                 **kw) -> None:
        first = LyingRound(n, security=security, round_id=1, flow=MERGED, seed=5, **kw)
        first.config = dataclasses.replace(first.config, advertise_ahead=True)
        first.server = SecAggServer(first.config)
        first.outbox = first.server.start()
        first.run()
        assert first.server.status is Status.COMPLETED
        super().__init__(n, security=security, corrupt=corrupt, round_id=2, flow=MERGED, **kw)
        self.config = dataclasses.replace(self.config, keys_ahead=True, advertise_ahead=True)
        self.server = SecAggServer(self.config, ahead=first.server.ahead)
        for c, client in self.clients.items():
            client.inherit(first.clients[c].carry_over())
        self.sent = {(MsgType.ADVERTISE_KEYS, c): a for c, a in first.server.ahead.items()}
        self.outbox = self.server.start()

    def deliver(self, c: int, payload: bytes) -> bytes | None:
        reply = super().deliver(c, payload)
        if reply is not None and msg.read_header(reply).kind is MsgType.UNMASK_AND_ADVERTISE:
            self.sent[(MsgType.UNMASK_RESPONSE, c)] = msg.unbundle(reply)[1]
        return reply


def test_a_substituted_key_in_the_ahead_public_keys_is_refused():
    fake = kx.public_bytes(kx.new_private_key())

    def swap(c: int, m: msg.PublicKeys) -> msg.PublicKeys:
        entries = tuple(dataclasses.replace(e, c_pk=fake) if e.client_id == 1 else e
                        for e in m.entries)
        return dataclasses.replace(m, entries=entries)

    r = AheadLyingRound(7)
    neighbours = set(r.server.neighbours[1])
    r.run(only(neighbours, MsgType.SETUP_AND_KEYS, _rebundled(swap)))
    refused(r, neighbours, "client 1's advertisement: bad signature")
    r.assert_nobody_rebuilt()


def test_an_ahead_list_without_the_clients_own_advertisement_is_refused():
    fake = bytes(32)

    def own(c: int, m: msg.PublicKeys) -> msg.PublicKeys:
        listed = tuple((v, fake if v == c else d) for v, d in m.advertised)
        return dataclasses.replace(m, advertised=listed)

    r = AheadLyingRound(7)
    r.run(only({2}, MsgType.SETUP_AND_KEYS, _rebundled(own)))
    refused(r, [2], "advertisement list lacks this client's own advertisement")


@pytest.mark.parametrize("security", MODES)
def test_the_dropout_lie_in_the_ahead_round(security, monkeypatch):
    """The dropout lie of the malicious-server tests, in a round whose keys came ahead:
    client 1's input is rebuilt in the semi-honest mode (the lie works there, so the test
    can see it) and refused in the malicious mode, where nobody's is."""
    monkeypatch.setattr(tsm, "LyingRound", AheadLyingRound)
    r = tsm.dropout_lie(security, MERGED)
    assert r.server.config.keys_ahead
    if security == SEMI_HONEST:
        assert r.errors == {}
        np.testing.assert_array_equal(r.rebuild(1), r.inputs[0])
        return
    refused(r, (4, 5), "4 consistency signatures, 5 needed")
    r.assert_nobody_rebuilt()


@pytest.mark.parametrize("security", MODES)
def test_an_honest_ahead_round_rebuilds_no_input(security):
    r = AheadLyingRound(8, security=security, corrupt={7, 8})
    r.run()
    assert r.server.status is Status.COMPLETED and r.server.merged
    r.assert_nobody_rebuilt()


@pytest.mark.parametrize("security", MODES)
def test_client_state_survives_export_and_import_between_and_within_rounds(security):
    run = Run(security)
    run.round(1)
    extra = ({"identity": IDENTITIES, "trusted": TRUST_ALL}
             if security == MALICIOUS else {})
    restored = {}
    for c, client in run.clients.items():  # what a node keeps between rounds, restored
        own = ({"identity": extra["identity"][c], "trusted": TRUST_ALL, "security": MALICIOUS}
               if extra else {})
        restored[c] = SecAggClient.from_state(client.carry_over().export_state(), **own)
        assert restored[c].advertised_ahead == (RUN, 2)
    run.clients = restored
    saved = {}

    def reload(stage, src, dst, payload):  # every client saved and restored mid-round too
        if src is not None:
            client = run_clients[src]
            own = ({"identity": IDENTITIES[src], "trusted": TRUST_ALL,
                    "security": MALICIOUS} if security == MALICIOUS else {})
            again = SecAggClient.from_state(client.export_state(), **own)
            assert again.export_state() == client.export_state()
            saved[src] = again
        return payload

    run_clients: dict[int, SecAggClient] = {}
    inputs = _inputs(2)
    kw = {"identities": IDENTITIES, "trusted": TRUST_ALL} if security == MALICIOUS else {}
    ex: list[int] = []
    total, server = run_secagg_round(inputs, ids=IDS, k=4, t=3, run_id=RUN, round_id=2,
                                     security=security, pending=run.pending,
                                     previous=run.clients, exchanges=ex, intercept=reload,
                                     clients_out=run_clients, **kw)
    assert server.config.keys_ahead and ex == [EXCHANGES[security] - 1]
    np.testing.assert_array_equal(total, _sum(inputs, IDS, IDS))
    assert saved and all(s.advertised_ahead == (RUN, 3) for s in saved.values())


def test_bundles_round_trip_and_check_their_parts():
    config = SessionParams.create(IDS, DIM, run_id=RUN, round_id=4, keys_ahead=True,
                                  advertise_ahead=True)
    setup = msg.encode_setup(config, 2)
    assert msg.decode_setup(setup)[1] == config
    keys = msg.encode_public_keys(msg.Header(MsgType.PUBLIC_KEYS, RUN, 4, 2), msg.PublicKeys(()))
    h, a, b = msg.unbundle(msg.bundle(MsgType.SETUP_AND_KEYS, setup, keys))
    assert (h.kind, h.round_id, h.client_id, a, b) == (MsgType.SETUP_AND_KEYS, 4, 2, setup, keys)
    other = msg.encode_public_keys(msg.Header(MsgType.PUBLIC_KEYS, RUN, 5, 2), msg.PublicKeys(()))
    with pytest.raises(ProtocolError, match="expected run 11 round 4 client 2"):
        msg.unbundle(msg.bundle(MsgType.SETUP_AND_KEYS, setup, other))
    with pytest.raises(ProtocolError, match="expected a PUBLIC_KEYS message"):
        msg.unbundle(msg.bundle(MsgType.SETUP_AND_KEYS, setup, setup))
    advert = msg.encode_advertise_keys(msg.Header(MsgType.ADVERTISE_KEYS, RUN, 5, 2),
                                       msg.AdvertiseKeys(bytes(32), bytes(32), bytes(32)))
    response = msg.encode_unmask_response(msg.Header(MsgType.UNMASK_RESPONSE, RUN, 4, 2),
                                          msg.UnmaskResponse(()))
    assert msg.unbundle(msg.bundle(MsgType.UNMASK_AND_ADVERTISE, response, advert))[2] == advert
    stale = msg.encode_advertise_keys(msg.Header(MsgType.ADVERTISE_KEYS, RUN, 4, 2),
                                      msg.AdvertiseKeys(bytes(32), bytes(32), bytes(32)))
    with pytest.raises(ProtocolError):  # an advertisement for this round, not the next
        msg.unbundle(msg.bundle(MsgType.UNMASK_AND_ADVERTISE, response, stale))
    with pytest.raises(ProtocolError, match="unknown security mode"):
        msg.decode_setup(setup[:-1] + bytes([0x20]))  # ahead without the merged flow
    with pytest.raises(ValueError, match="need the merged flow"):
        dataclasses.replace(config, flow="classic")
