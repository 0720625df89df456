"""The secure-aggregation policy, enforced by both state machines on what they are sent.

Hostile SETUPs (k = 1, t = 1; k = 2 cycles; a disconnected graph; t <= k/2; two clients)
and unmask requests listing too few survivors are refused by every client; the server
aborts before requesting any share when fewer than ``min_survivors`` clients, or a
disconnected set of them, survive. Connectivity is checked here with scipy's csgraph, not
with the code under test.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from privacy.secagg import (
    DEFAULT_POLICY,
    ProtocolError,
    SecAggClient,
    SecAggPolicy,
    SecAggServer,
    SessionParams,
    Stage,
    Status,
    params,
    run_secagg_round,
)
from privacy.secagg import messages as m
from privacy.secagg.graph import SeededStream, regular_graph
from privacy.secagg.messages import Header, MsgType, encode_setup, read_header

DIM = 16
SEED = hashlib.sha256(b"policy").digest()


def components(n: int, k: int, seed: bytes, without: tuple[int, ...] = ()) -> int:
    """Connected components of the seed's graph on nodes 0..n-1, less ``without``."""
    keep = [u for u in range(n) if u not in without]
    index = {u: i for i, u in enumerate(keep)}
    edges = [(index[u], index[v]) for u in keep for v in regular_graph(n, k, seed)[u]
             if v in index]
    rows, cols = zip(*edges, strict=True) if edges else ((), ())
    adjacency = csr_matrix((np.ones(len(edges)), (rows, cols)), shape=(len(keep),) * 2)
    return connected_components(adjacency, directed=False)[0]


def forged(n: int, k: int, t: int, seed: bytes = bytes(range(32))) -> SessionParams:
    """A structurally valid configuration, whatever the policy says of it."""
    return SessionParams(tuple(range(1, n + 1)), k, t, 32, DIM, 0, 0, seed)


def ring(n: int, seed: bytes) -> list[int]:
    """The nodes in the order of the seed's permutation: the graph joins ring neighbours
    up to floor(k/2) apart (:mod:`privacy.secagg.graph`)."""
    return SeededStream(seed, b"graph-order").permutation(n).tolist()


def test_the_forged_graphs_are_what_the_tests_say():
    assert components(4, 1, bytes(32)) == 2  # a perfect matching
    assert components(8, 1, SEED) == 4
    assert components(6, 2, SEED) == 1  # one cycle, which two removals split
    order = ring(6, SEED)
    assert components(6, 2, SEED, (order[0], order[3])) == 2
    order = ring(10, SEED)  # k = 4: two runs of two positions split it, one run does not
    assert components(10, 4, SEED, tuple(order[p] for p in (0, 1, 5, 6))) == 2
    assert components(10, 4, SEED, tuple(order[p] for p in (0, 1, 5))) == 1


HOSTILE_SETUPS = [
    ("k = 1, t = 1 (a perfect matching)", forged(4, 1, 1), "k = 1 neighbours is below"),
    ("k = 2 (cycles)", forged(6, 2, 2), "k = 2 neighbours is below the minimum 3"),
    ("t = k/2", forged(5, 4, 2), "threshold t = 2 is not more than half of k = 4"),
    ("t = 1 on the full graph", forged(4, 3, 1), "threshold t = 1 is not more than half"),
    ("two clients (full graph k = 1)", forged(2, 1, 1), "2 participants can never give"),
]


@pytest.mark.parametrize(("config", "fragment"), [c[1:] for c in HOSTILE_SETUPS],
                         ids=[c[0] for c in HOSTILE_SETUPS])
def test_every_client_refuses_a_setup_below_policy(config, fragment):
    for c in config.participants:
        client = SecAggClient(c)
        with pytest.raises(ProtocolError, match="secure-aggregation policy") as err:
            client.handle(encode_setup(config, c))
        assert fragment in err.value.reason
        assert client.stage is Stage.SETUP and client.config is None  # nothing kept


@pytest.mark.parametrize(("config", "fragment"), [c[1:] for c in HOSTILE_SETUPS],
                         ids=[c[0] for c in HOSTILE_SETUPS])
def test_the_server_refuses_to_run_a_session_below_policy(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        SecAggServer(config)


def test_a_disconnected_graph_is_refused_where_the_minimum_degree_is_lowered():
    # a Harary graph is k-connected: only k = 1 (a matching) is disconnected, and the
    # default policy refuses it for its degree first
    policy = SecAggPolicy(min_neighbors=1, min_survivors=2, require_majority=False)
    config = forged(8, 1, 1, SEED)
    for c in config.participants:
        with pytest.raises(ProtocolError, match="8, k = 1\\) from the seed is disconnected"):
            SecAggClient(c, policy=policy).handle(encode_setup(config, c))
    with pytest.raises(ValueError, match="is disconnected"):
        SecAggServer(config, policy)
    assert policy.violation(forged(2, 1, 1, SEED)) is None  # two nodes: one edge


@pytest.mark.parametrize(("n", "k", "t"), [(3, 2, 2), (4, 3, 2), (8, 3, 2), (10, 4, 3)])
def test_smallest_conforming_setups_are_accepted(n, k, t):
    config = SessionParams.create(range(1, n + 1), DIM, k=k, t=t)
    assert components(n, k, config.seed) == 1
    for c in config.participants:
        SecAggClient(c).handle(encode_setup(config, c))
    SecAggServer(config)


def test_a_client_refuses_restoring_a_session_below_its_policy():
    config = SessionParams.create(range(1, 7), DIM, k=4, t=3)
    client = SecAggClient(1)
    client.handle(encode_setup(config, 1))
    saved = client.export_state()
    strict = DEFAULT_POLICY.raised(min_neighbors=5)  # this node asks for more than k = 4
    with pytest.raises(ProtocolError, match="k = 4 neighbours is below the minimum 5"):
        SecAggClient.from_state(saved, policy=strict)


def test_a_client_raises_its_own_minimums_and_never_lowers_them():
    config = SessionParams.create(range(1, 11), DIM, k=4, t=3)
    strict = DEFAULT_POLICY.raised(min_neighbors=5)
    with pytest.raises(ProtocolError, match="below the minimum 5"):
        SecAggClient(1, policy=strict).handle(encode_setup(config, 1))
    SecAggClient(1).handle(encode_setup(config, 1))  # the default takes k = 4
    with pytest.raises(ProtocolError, match="3 participants can never give the 4"):
        SecAggClient(1, policy=DEFAULT_POLICY.raised(min_survivors=4)).handle(
            encode_setup(SessionParams.create([1, 2, 3], DIM), 1))
    for lower in ({"min_neighbors": 2}, {"min_survivors": 2}, {"min_survivors": True}):
        with pytest.raises(ValueError, match="can only be raised"):
            DEFAULT_POLICY.raised(**lower)


def test_create_draws_one_seed_whose_graph_is_connected(monkeypatch):
    draws = []

    def urandom(size: int) -> bytes:
        draws.append(hashlib.sha256(b"draw %d" % len(draws)).digest()[:size])
        return draws[-1]

    monkeypatch.setattr(params.os, "urandom", urandom)
    for n in (8, 9, 10, 40):
        draws.clear()
        config = SessionParams.create(range(1, n + 1), DIM, k=4, t=3)
        assert draws == [config.seed]  # drawn once: every seed's graph is 4-connected
        assert components(n, 4, config.seed) == 1
    kept = SessionParams.create(range(1, 9), DIM, k=3, t=2, seed=SEED)
    assert kept.seed == SEED  # an explicit seed is kept


@pytest.mark.parametrize("n", [3, 4, 6, 10, 60])
def test_default_k_and_t_meet_the_policy(n):
    config = SessionParams.create(range(1, n + 1), DIM)
    assert config.k >= 3 or config.k == n - 1
    assert 2 * config.t > config.k
    assert DEFAULT_POLICY.violation(config) is None


# --- unmasking: no share unless enough clients survive ------------------------------------


def _at_unmasking(lockstep, make_inputs, n=5, **kw):
    r = lockstep(make_inputs(n, DIM, 32), k=n - 1, t=n // 2 + 1, **kw)
    for _ in range(3):
        r.step()
    assert r.server.stage is Stage.UNMASKING
    return r


def _request(c: int, survivors: tuple[int, ...], dropped: tuple[int, ...] = ()) -> bytes:
    h = Header(MsgType.UNMASK_REQUEST, 0, 0, c)
    return m.encode_unmask_request(h, m.UnmaskRequest(survivors, dropped))


def test_every_client_refuses_an_unmask_request_listing_too_few_survivors(lockstep, make_inputs):
    r = _at_unmasking(lockstep, make_inputs)
    for c, client in r.clients.items():
        others = sorted(set(r.clients) - {c})
        for survivors, dropped in (((others[0],), ()), ((others[0],), tuple(others[1:])),
                                   ((), tuple(others))):
            with pytest.raises(ProtocolError, match="fewer than the minimum 3"):
                client.handle(_request(c, survivors, dropped))
        # itself and two listed survivors are three: answered (the refusals changed nothing)
        reply = client.handle(_request(c, tuple(others[:2])))
        assert read_header(reply).kind is MsgType.UNMASK_RESPONSE


def test_a_client_counts_survivors_against_its_own_minimum(lockstep, make_inputs):
    strict = DEFAULT_POLICY.raised(min_survivors=5)
    r = _at_unmasking(lockstep, make_inputs, n=6)
    c = 1
    session = SecAggClient.from_state(r.clients[c].export_state(), policy=strict)
    with pytest.raises(ProtocolError, match="4 survivors, fewer than the minimum 5"):
        session.handle(_request(c, (2, 3, 4)))
    session.handle(_request(c, (2, 3, 4, 5)))
    assert r.clients[c].handle(_request(c, (2, 3, 4)))  # the default policy answers


def test_the_server_aborts_below_min_survivors_before_any_share(make_inputs):
    seen = []

    def spy(stage, sender, receiver, payload):
        seen.append(read_header(payload).kind)
        return payload

    inputs = make_inputs(6, DIM, 32)
    policy = SecAggPolicy(min_survivors=5)
    drop = {5: Stage.MASKED_INPUT, 6: Stage.MASKED_INPUT}  # 4 survive, 3 hold each secret
    total, server = run_secagg_round(inputs, k=5, t=3, drop=drop, intercept=spy, policy=policy)
    assert total is None and server.status is Status.ABORTED
    assert "4 survivors, fewer than the minimum 5" in server.abort_reason
    assert "no share was requested" in server.abort_reason
    assert MsgType.UNMASK_REQUEST not in seen
    # one survivor more is enough
    total, server = run_secagg_round(inputs, k=5, t=3, drop={6: Stage.MASKED_INPUT},
                                     policy=policy)
    assert server.status is Status.COMPLETED and len(server.survivors) == 5


def test_the_default_server_reveals_no_sum_of_two(make_inputs):
    # n = 3, full graph, t = 2: one dropout leaves two, whose sum is never revealed
    inputs = make_inputs(3, DIM, 32)
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS):  # too few neighbours left, too
        total, server = run_secagg_round(inputs, drop={3: stage})
        assert total is None and server.status is Status.ABORTED, stage
    total, server = run_secagg_round(inputs, drop={3: Stage.MASKED_INPUT})
    assert total is None and server.status is Status.ABORTED
    assert "2 survivors, fewer than the minimum 3" in server.abort_reason
    total, server = run_secagg_round(inputs)
    assert server.status is Status.COMPLETED


def test_the_server_aborts_when_the_survivors_graph_splits(make_inputs):
    # k = 4 on 10 nodes: the clients at ring positions 0, 1 and 5, 6 (two runs of
    # h = 2) drop after masking; with t = 2 every secret still has t holders, but
    # positions 2-4 and 7-9 are apart and the server could unmask each side's sum on its
    # own. (With t > k/2 a survivor next to a run of h keeps k - h < t neighbours, and
    # the round would abort for that too; the connectivity check comes first.)
    policy = SecAggPolicy(require_majority=False)
    inputs = make_inputs(10, DIM, 32)
    client = [u + 1 for u in ring(10, SEED)]  # the client at each position
    seen = []

    def spy(stage, sender, receiver, payload):
        seen.append(read_header(payload).kind)
        return payload

    drop = {client[p]: Stage.MASKED_INPUT for p in (0, 1, 5, 6)}
    total, server = run_secagg_round(inputs, k=4, t=2, seed=SEED, drop=drop, intercept=spy,
                                     policy=policy)
    assert total is None and server.status is Status.ABORTED
    assert "survivors' graph is disconnected" in server.abort_reason
    assert MsgType.UNMASK_REQUEST not in seen
    drop.pop(client[6])  # one run of two positions: still connected
    total, server = run_secagg_round(inputs, k=4, t=2, seed=SEED, drop=drop, policy=policy)
    assert server.status is Status.COMPLETED


def test_the_server_aborts_early_when_too_few_are_left_after_the_key_stages(make_inputs):
    inputs = make_inputs(6, DIM, 32)
    drop = {5: Stage.ADVERTISE_KEYS, 6: Stage.ADVERTISE_KEYS}
    total, server = run_secagg_round(inputs, k=5, t=3, drop=drop,
                                     policy=SecAggPolicy(min_survivors=5))
    assert total is None and server.stage is Stage.ADVERTISE_KEYS
    assert server.abort_reason.startswith("after stage ADVERTISE_KEYS: 4 survivors")


# --- the client-side threshold checks on what the server forwards -------------------------


def test_a_client_given_fewer_than_t_public_keys_refuses(lockstep, make_inputs):
    r = lockstep(make_inputs(6, DIM, 32), k=5, t=3)
    r.step()
    h, keys = m.decode_public_keys(r.outbox[1])
    assert len(keys.entries) == 5
    client = r.clients[1]
    for few in (0, 1, 2):
        short = m.encode_public_keys(h, m.PublicKeys(keys.entries[:few]))
        with pytest.raises(ProtocolError, match=f"only {few} neighbours left, threshold is 3"):
            client.handle(short)
    reply = client.handle(m.encode_public_keys(h, m.PublicKeys(keys.entries[:3])))
    assert len(m.decode_share_keys(reply)[1].shares) == 3  # exactly t: shares for three


def _forwarded_with_bad(r, client: int, bad: int) -> bytes:
    """The FORWARDED_SHARES for ``client`` with the first ``bad`` ciphertexts corrupted."""
    h, fwd = m.decode_forwarded_shares(r.outbox[client])
    shares = [(s, bytes([ct[0] ^ 1]) + ct[1:]) if i < bad else (s, ct)
              for i, (s, ct) in enumerate(fwd.shares)]
    return m.encode_forwarded_shares(h, m.ForwardedShares(tuple(shares)))


def test_a_client_given_fewer_than_t_valid_shares_refuses(lockstep, make_inputs):
    r = lockstep(make_inputs(6, DIM, 32), k=5, t=3)
    r.step()
    r.step()
    client = r.clients[1]
    for bad in (3, 4, 5):  # 2, 1, 0 valid shares
        with pytest.raises(ProtocolError, match=f"only {5 - bad} valid shares from "
                                                "neighbours, threshold is 3"):
            client.handle(_forwarded_with_bad(r, 1, bad))
    reply = client.handle(_forwarded_with_bad(r, 1, 2))  # exactly t valid: it masks
    failed = m.decode_masked_input(reply)[1].failed
    assert len(failed) == 2 and client.held_peers.isdisjoint(failed)
    assert len(client.held_peers) == 3


def test_every_policy_minimum_is_enforced_exactly_at_its_edge():
    for k, t, ok in ((4, 2, False), (4, 3, True), (5, 2, False), (5, 3, True), (6, 3, False),
                     (6, 4, True)):
        config = SessionParams.create(range(1, 11), DIM, k=k, t=t)
        assert (DEFAULT_POLICY.violation(config) is None) is ok, (k, t)
    assert DEFAULT_POLICY.survivors_violation(3) is None
    assert DEFAULT_POLICY.survivors_violation(2) is not None
    assert DEFAULT_POLICY.violation(forged(3, 2, 2)) is None  # n = 3: the full graph is fine
    assert DEFAULT_POLICY.violation(forged(10, 2, 2)) is not None


def test_a_session_at_the_policy_minimum_sums_exactly(make_inputs, exact_sum):
    inputs = make_inputs(8, DIM, 32)
    total, server = run_secagg_round(inputs, k=3, t=2)
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, range(1, 9), 32))


def test_the_default_corrupt_fraction_feeds_bells_bound_at_n_100():
    # independently (scipy): the smallest k whose t = floor(k/2) + 1 keeps both
    # n * P[Bin(k, 0.9) < t] <= 2^-20 (10% dropouts) and n * P[Bin(k, 0.05) >= t] <= 2^-40
    from scipy.stats import binom

    from privacy.secagg import default_k

    def meets(n: int, k: int, gamma: float) -> bool:
        t = k // 2 + 1
        return (n * binom.cdf(t - 1, k, 0.9) <= 2.0**-20
                and n * binom.sf(t - 1, k, gamma) <= 2.0**-40)

    expected = next(k for k in range(3, 99) if meets(100, k, 0.05))
    assert expected == 34 and not meets(100, 31, 0.05)  # 31: the bound at gamma = 0
    assert default_k(100) == expected
    assert SessionParams.create(range(1, 101), DIM).k == expected
    assert default_k(100, corrupt_fraction=0.1) == next(k for k in range(3, 99)
                                                         if meets(100, k, 0.1))


# --- Bell et al.'s privacy bound: the share of clients with t corrupt neighbours ----------


@pytest.mark.parametrize(("k", "t", "gamma"), [(3, 2, 0.05), (3, 3, 0.05), (4, 3, 0.05),
                                               (19, 10, 0.05), (34, 18, 0.05), (56, 29, 0.1),
                                               (7, 4, 1 / 3)])
def test_the_exposed_fraction_is_the_binomial_tail_computed_by_scipy(k, t, gamma):
    from scipy.stats import binom

    expected = sum(binom.pmf(i, k, gamma) for i in range(t, k + 1))  # P[>= t of k corrupt]
    assert params.exposed_fraction(k, t, gamma) == pytest.approx(expected, rel=1e-9)


def test_the_tracker_example_exposes_about_seven_in_a_thousand_clients():
    # k = 3, t = 2, gamma = 0.05: P[2 or 3 of 3 neighbours corrupt] = 3 g^2 (1-g) + g^3
    from scipy.stats import binom, hypergeom

    g = 0.05
    by_hand = 3 * g**2 * (1 - g) + g**3
    assert by_hand == pytest.approx(0.00725) and binom.sf(1, 3, g) == pytest.approx(by_hand)
    assert params.exposed_fraction(3, 2, g) == pytest.approx(by_hand, rel=1e-12)
    # 20 clients: 0.145 expected, far above 2^-40; a fixed gamma * n = 1 corrupt client in
    # the cohort (hypergeometric) could never be two neighbours, hence the binomial
    assert not params.meets_security(20, 3, 2, g)
    assert hypergeom.sf(1, 19, 1, 3) == 0.0


def test_meets_security_is_n_times_the_tail_against_two_to_the_minus_forty():
    from scipy.stats import binom

    def meets(n: int, k: int, gamma: float) -> bool:
        return bool(n * binom.sf(k // 2, k, gamma) <= 2.0**-40)

    for n, gamma in ((100, 0.05), (1000, 0.05), (100, 0.1), (10_000, 0.05)):
        for k in range(3, 80):
            assert params.meets_security(n, k, k // 2 + 1, gamma) is meets(n, k, gamma), \
                (n, k, gamma)
    assert params.meets_security(100, 34, 18, 0.05) and not params.meets_security(
        100, 33, 17, 0.05)
    assert params.meets_security(100, 33, 17, 0.05, security_bits=36)  # 4.1e-12 <= 2^-36
    # the full graph (k = n - 1) first meets it at n = 33; below, "auto" takes it anyway
    full = next(n for n in range(4, 100) if bool((n * binom.sf((n - 1) // 2, n - 1, 0.05))
                                                 <= 2.0**-40))
    assert full == 33 and params.meets_security(33, 32, 17, 0.05)
    assert not params.meets_security(32, 31, 16, 0.05) and params.default_k(32) == 31
