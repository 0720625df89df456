"""End-to-end rounds through the byte messages: exact sums, dropouts, thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.secagg import (
    DEFAULT_POLICY,
    MECHANICS_ONLY,
    Aborted,
    SecAggClient,
    Stage,
    Status,
    check_headroom,
    dequantize_weighted,
    quantize_weighted,
    run_secagg_round,
)
from privacy.secagg.messages import MsgType, read_header
from privacy.secagg.quantize import error_bound

DIM = 1000
DROP_STAGES = [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING]
# n -> (k, t, clients to drop, policy); None = the defaults for n; n = 2 and 3 test the
# mechanics below the policy (the default policy refuses them: test_secagg_policy.py)
CASES = {2: (1, 1, [2], MECHANICS_ONLY), 3: (2, 1, [3], MECHANICS_ONLY),
         10: (5, 3, [3, 8], DEFAULT_POLICY), 50: (None, None, [4, 9, 17, 30, 44], DEFAULT_POLICY)}


def _in_sum(n: int, dropped: list[int], stage: Stage | None) -> list[int]:
    """Whose inputs the sum must contain: those dropping in unmasking already sent theirs."""
    gone = set(dropped) if stage is not None and stage < Stage.UNMASKING else set()
    return [c for c in range(1, n + 1) if c not in gone]


@pytest.mark.parametrize("n", sorted(CASES))
@pytest.mark.parametrize("stage", [None, *DROP_STAGES], ids=lambda s: getattr(s, "name", "none"))
def test_exact_sum_with_dropouts(n, stage, make_inputs, exact_sum):
    k, t, dropped, policy = CASES[n]
    bits = 32
    inputs = make_inputs(n, DIM, bits, seed=n)
    drop = {c: stage for c in dropped} if stage is not None else {}
    total, server = run_secagg_round(inputs, k=k, t=t, bits=bits, drop=drop, policy=policy)
    if n == 2 and stage is not None:
        # the lone survivor's secrets have no holder left: abort, reveal nothing
        assert total is None and server.status is Status.ABORTED
        with pytest.raises(Aborted):
            server.result()
        return
    assert server.status is Status.COMPLETED, server.abort_reason
    expected_ids = _in_sum(n, dropped, stage)
    assert sorted(server.survivors) == expected_ids
    np.testing.assert_array_equal(total, exact_sum(inputs, expected_ids, bits))
    for s in DROP_STAGES:
        assert server.dropouts[s] == (set(dropped) if s == stage else set())
    assert server.rejected == {}


@pytest.mark.parametrize("bits", [1, 13, 32, 40, 64])
def test_exact_sum_other_bit_widths(bits, make_inputs, exact_sum):
    inputs = make_inputs(6, 257, bits, seed=bits)
    total, server = run_secagg_round(
        inputs, k=5, t=3, bits=bits, drop={2: Stage.MASKED_INPUT, 5: Stage.UNMASKING}
    )
    assert server.status is Status.COMPLETED
    assert total.dtype == (np.uint32 if bits <= 32 else np.uint64)
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 3, 4, 5, 6], bits))


@pytest.mark.parametrize("n", sorted(CASES))
@pytest.mark.parametrize(
    "stage", [None, Stage.SHARE_KEYS, Stage.UNMASKING], ids=lambda s: getattr(s, "name", "none")
)
def test_weighted_float_sum_within_quantization_bound(n, stage):
    k, t, dropped, policy = CASES[n]
    if n == 2 and stage is not None:
        pytest.skip("two clients cannot tolerate a dropout (covered above)")
    rng = np.random.default_rng(100 + n)
    clip, max_weight, bits, scale = 0.5, 4.0, 32, 2.0**16
    check_headroom(n, bits, clip, max_weight, scale=scale)
    updates = [rng.normal(0, 0.3, DIM) for _ in range(n)]
    weights = rng.uniform(0, max_weight, n)
    weights[0] = max_weight
    quantized = [
        quantize_weighted(
            u, w, bits=bits, clip_range=clip, scale=scale, max_weight=max_weight, rng=rng
        )
        for u, w in zip(updates, weights, strict=True)
    ]
    drop = {c: stage for c in dropped} if stage is not None else {}
    total, server = run_secagg_round(quantized, k=k, t=t, bits=bits, drop=drop,
                                     policy=policy)
    assert server.status is Status.COMPLETED
    ids = sorted(server.survivors)
    assert ids == _in_sum(n, dropped, stage)
    sum_wx, sum_w = dequantize_weighted(
        total, len(ids), clip_range=clip, scale=scale, max_weight=max_weight
    )
    exact_wx = sum(weights[c - 1] * np.clip(updates[c - 1], -clip, clip) for c in ids)
    bound = error_bound(len(ids), scale) + 1e-9
    assert np.max(np.abs(sum_wx - exact_wx)) <= bound
    assert abs(sum_w - sum(weights[c - 1] for c in ids)) <= bound


def _full_graph(n: int, t: int, make_inputs) -> tuple[list[np.ndarray], dict]:
    return make_inputs(n, 64, 32), {"k": n - 1, "t": t}


def test_exactly_t_shares_after_masking_dropouts_succeed(make_inputs, exact_sum):
    # full graph n=5, t=3: with one dropout, each survivor's self-mask has 3 holders
    inputs, kw = _full_graph(5, 3, make_inputs)
    total, server = run_secagg_round(inputs, drop={5: Stage.MASKED_INPUT}, **kw)
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 2, 3, 4], 32))


def test_t_minus_one_holders_abort_before_any_share_is_requested(make_inputs):
    inputs, kw = _full_graph(5, 3, make_inputs)
    seen = []

    def spy(stage, sender, receiver, payload):
        seen.append(read_header(payload).kind)
        return payload

    drop = {4: Stage.MASKED_INPUT, 5: Stage.MASKED_INPUT}
    total, server = run_secagg_round(inputs, drop=drop, intercept=spy, **kw)
    assert total is None and server.status is Status.ABORTED
    assert "2 of 3 shares" in server.abort_reason and "no share was requested" in (
        server.abort_reason
    )
    assert MsgType.UNMASK_REQUEST not in seen and MsgType.UNMASK_RESPONSE not in seen
    assert server.dropouts[Stage.MASKED_INPUT] == {4, 5}
    with pytest.raises(Aborted, match="2 of 3"):
        server.result()


def test_exactly_t_responders_in_unmasking_succeed(make_inputs, exact_sum):
    inputs, kw = _full_graph(5, 3, make_inputs)
    total, server = run_secagg_round(inputs, drop={5: Stage.UNMASKING}, **kw)
    assert server.status is Status.COMPLETED
    np.testing.assert_array_equal(total, exact_sum(inputs, [1, 2, 3, 4, 5], 32))
    assert server.dropouts[Stage.UNMASKING] == {5}


def test_t_minus_one_responders_in_unmasking_abort(make_inputs):
    inputs, kw = _full_graph(5, 3, make_inputs)
    drop = {4: Stage.UNMASKING, 5: Stage.UNMASKING}
    total, server = run_secagg_round(inputs, drop=drop, **kw)
    assert total is None and server.status is Status.ABORTED
    assert "only 2 of 3 shares" in server.abort_reason
    assert server.dropouts[Stage.UNMASKING] == {4, 5}


def test_too_few_neighbours_after_key_stage_excludes_then_aborts(make_inputs):
    inputs, kw = _full_graph(4, 3, make_inputs)
    drop = {3: Stage.ADVERTISE_KEYS, 4: Stage.ADVERTISE_KEYS}
    total, server = run_secagg_round(inputs, drop=drop, **kw)
    assert total is None and server.status is Status.ABORTED
    assert set(server.excluded) == {1, 2}
    assert server.dropouts == {Stage.ADVERTISE_KEYS: {3, 4}}


def test_dropped_at_masking_needs_its_key_not_its_seed(lockstep, make_inputs, exact_sum):
    inputs = make_inputs(6, 32, 32)
    r = lockstep(inputs, k=5, t=3)
    r.step()
    r.step()
    r.step(skip=[6])
    requests = r.outbox
    from privacy.secagg.messages import decode_unmask_request

    for c, payload in requests.items():
        _, req = decode_unmask_request(payload)
        assert 6 in req.dropped and 6 not in req.survivors
        assert set(req.survivors) == {1, 2, 3, 4, 5} - {c}
    r.step()
    np.testing.assert_array_equal(r.server.result(), exact_sum(inputs, [1, 2, 3, 4, 5], 32))


def test_client_state_survives_export_between_messages(make_inputs, exact_sum):
    from privacy.secagg import SecAggServer, SessionParams

    inputs = make_inputs(5, 100, 20)
    config = SessionParams.create([1, 2, 3, 4, 5], 100, bits=20, k=4, t=3, run_id=7, round_id=3)
    server = SecAggServer(config)
    states = {c: SecAggClient(c, run_id=7, round_id=3).export_state() for c in range(1, 6)}
    outbox = server.start()
    while server.status is Status.RUNNING:
        for c, payload in outbox.items():
            client = SecAggClient.from_state(states[c])  # a fresh process per message
            client.set_input(inputs[c - 1])
            server.receive(c, client.handle(payload))
            states[c] = client.export_state()
        outbox = server.advance()
    np.testing.assert_array_equal(server.result(), exact_sum(inputs, [1, 2, 3, 4, 5], 20))
    restored = SecAggClient.from_state(states[1])
    assert restored.stage is Stage.UNMASKING and restored.held_peers == {2, 3, 4, 5}
    assert (restored.expected_run_id, restored.expected_round_id) == (7, 3)
    only_round = SecAggClient.from_state(SecAggClient(4, round_id=9).export_state())
    assert (only_round.expected_run_id, only_round.expected_round_id) == (None, 9)


def test_client_refuses_out_of_order_and_setup_of_other_round(make_inputs):
    from privacy.secagg import ProtocolError, SessionParams
    from privacy.secagg.messages import encode_setup

    config = SessionParams.create([1, 2, 3], 10, k=2, t=2, round_id=5)
    with pytest.raises(ProtocolError, match="round 5, expected 4"):
        SecAggClient(1, round_id=4).handle(encode_setup(config, 1))
    with pytest.raises(ProtocolError, match="addressed to client 2"):
        SecAggClient(1).handle(encode_setup(config, 2))
    client = SecAggClient(1)
    client.handle(encode_setup(config, 1))
    with pytest.raises(ProtocolError, match="not expected"):
        client.handle(encode_setup(config, 1))


def test_restored_sessions_need_no_key_agreement_and_keep_no_private_key(
    make_inputs, exact_sum, monkeypatch
):
    from privacy.secagg import SecAggServer, SessionParams
    from privacy.secagg import keys as kx

    inputs = make_inputs(5, 100, 32)
    config = SessionParams.create([1, 2, 3, 4, 5], 100, k=4, t=3, run_id=2, round_id=1)
    server = SecAggServer(config)
    states = {c: SecAggClient(c).export_state() for c in range(1, 6)}
    private: dict[int, list[bytes]] = {}
    agreements = []
    real_agree = kx.agree
    monkeypatch.setattr(kx, "agree", lambda *a: agreements.append(1) or real_agree(*a))
    outbox = server.start()
    while server.status is Status.RUNNING:
        stage = server.stage
        for c, payload in outbox.items():
            before = len(agreements)
            client = SecAggClient.from_state(states[c])
            assert len(agreements) == before  # restoring derives nothing
            if stage is Stage.SHARE_KEYS:  # the keys made at SETUP, used once here
                private[c] = [kx.private_bytes(client._c_sk), kx.private_bytes(client._s_sk)]
                assert all(key in states[c] for key in private[c])
            client.set_input(inputs[c - 1])
            server.receive(c, client.handle(payload))
            states[c] = client.export_state()
            if stage is Stage.MASKED_INPUT:  # pair seeds were derived with the shares
                assert len(agreements) == before
            if stage >= Stage.SHARE_KEYS:
                assert not any(key in states[c] for key in private[c])
        outbox = server.advance()
    np.testing.assert_array_equal(server.result(), exact_sum(inputs, [1, 2, 3, 4, 5], 32))
    assert set(server.cpu_seconds) == set(DROP_STAGES) - {Stage.MASKED_INPUT}  # merged flow


def test_client_state_must_match_its_stage():
    from privacy.secagg import ProtocolError, SessionParams
    from privacy.secagg.messages import encode_setup

    config = SessionParams.create([1, 2, 3], 10, k=2, t=2)
    client = SecAggClient(1)
    client.handle(encode_setup(config, 1))
    state = bytearray(client.export_state())
    state[3] = Stage.SHARE_KEYS  # the stage byte: keys but no neighbour secrets
    with pytest.raises(ProtocolError, match="does not match stage SHARE_KEYS"):
        SecAggClient.from_state(bytes(state))
    assert SecAggClient.from_state(client.export_state()).stage is Stage.ADVERTISE_KEYS
