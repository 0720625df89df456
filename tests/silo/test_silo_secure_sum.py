"""The SecAgg+ session takes one masked sum for all its clients (as a ring of silos gives it).

No processes here: the clients' masked vectors are summed outside the session, which must
unmask that sum exactly, and refuse a sum it cannot unmask before asking for any share;
the server reads a silo's ring reply, or says what is wrong with it.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, Metadata, MetricRecord, RecordDict

from client.protocol.ring import RingKey, RingRecord
from client.protocol.updates import delta_record
from privacy.secagg import CLASSIC, SecAggClient, SecAggServer, SessionParams, Stage, Status
from privacy.secagg.messages import decode_masked_input
from server.cross_silo import decode_reply

IDS = [11, 12, 13, 14, 15, 16]


def _session(bits: int, k: int) -> tuple[SecAggServer, dict[int, SecAggClient],
                                          dict[int, np.ndarray]]:
    rng = np.random.default_rng(5)
    server = SecAggServer(SessionParams.create(IDS, 1000, bits=bits, k=k, run_id=3,
                                              round_id=7, flow=CLASSIC))  # as over a ring
    clients = {c: SecAggClient(c, run_id=3, round_id=7) for c in IDS}
    inputs = {c: rng.integers(0, 1 << bits, 1000, dtype=np.uint64).astype(
        server.config.word_dtype) for c in IDS}
    for c, x in inputs.items():
        clients[c].set_input(x)
    return server, clients, inputs


def _to_masking(server: SecAggServer, clients: dict[int, SecAggClient]) -> dict[int, bytes]:
    """Run the key stages; the FORWARDED_SHARES messages."""
    outbox = server.start()
    while server.stage is not Stage.MASKED_INPUT:
        for c, payload in outbox.items():
            server.receive(c, clients[c].handle(payload))
        outbox = server.advance()
    return outbox


def _masked(clients: dict[int, SecAggClient], outbox: dict[int, bytes]) -> dict[int, tuple]:
    out = {}
    for c, payload in outbox.items():
        m = decode_masked_input(clients[c].handle(payload))[1]
        out[c] = (m.failed, np.array(m.vector))
    return out


@pytest.mark.parametrize(("bits", "k"), [(20, 3), (32, 5), (40, 3)])
def test_a_masked_sum_unmasks_to_the_sum_of_the_inputs(bits: int, k: int) -> None:
    server, clients, inputs = _session(bits, k)
    masked = _masked(clients, _to_masking(server, clients))
    total = np.zeros(1000, np.uint64)
    for _, vector in masked.values():
        total += vector.astype(np.uint64)
    total %= np.uint64(1 << bits)
    assert server.receive_sum(IDS, total, {c: f for c, (f, _) in masked.items()})
    outbox = server.advance()
    assert set(outbox) == set(IDS)  # self-mask shares of every survivor, nothing else
    for c, payload in outbox.items():
        server.receive(c, clients[c].handle(payload))
    server.advance()
    assert server.status is Status.COMPLETED
    expected = sum(x.astype(np.uint64) for x in inputs.values()) % np.uint64(1 << bits)
    np.testing.assert_array_equal(server.result(), expected)
    assert not np.array_equal(total, expected)  # the masks were there


def _refused(server: SecAggServer, senders: list[int], total: np.ndarray,
             failed: dict[int, tuple[int, ...]], reason: str) -> None:
    assert not server.receive_sum(senders, total, failed)
    assert server.status is Status.ABORTED and reason in (server.abort_reason or "")
    assert server.advance() == {}  # no share is ever requested


def test_a_sum_missing_a_client_is_refused() -> None:
    server, clients, _ = _session(20, 3)
    masked = _masked(clients, _to_masking(server, clients))
    partial = sum(v.astype(np.uint64) for c, (_, v) in masked.items() if c != IDS[0])
    _refused(server, IDS[1:], partial % np.uint64(1 << 20), {}, "the stage awaits exactly")


def test_a_failed_share_makes_the_sum_unusable() -> None:
    server, clients, _ = _session(20, 3)
    _to_masking(server, clients)
    total = np.zeros(1000, np.uint32)
    _refused(server, IDS, total, {IDS[2]: (IDS[3],)}, "could not authenticate the shares")


@pytest.mark.parametrize(("total", "reason"), [
    (np.zeros(999, np.uint32), "expected 1000 words"),
    (np.zeros(1000, np.float32), "expected 1000 words"),
    (np.full(1000, 1 << 20, np.uint32), "values >= 2^20"),
])
def test_a_malformed_sum_is_refused(total: np.ndarray, reason: str) -> None:
    server, clients, _ = _session(20, 3)
    _to_masking(server, clients)
    _refused(server, IDS, total, {}, reason)


def test_a_sum_is_taken_only_in_the_masking_stage() -> None:
    server, _, _ = _session(20, 3)
    server.start()
    with pytest.raises(RuntimeError, match="stage MASKED_INPUT"):
        server.receive_sum(IDS, np.zeros(1000, np.uint32))


def _ring_reply(failed: object, aggregate: np.ndarray | None) -> Message:
    content = RecordDict({"metrics": MetricRecord(), RingRecord.RESULT: ConfigRecord(
        {"status": "ok", "digest": "d", "count": 3, RingKey.FAILED: failed})})
    if aggregate is not None:
        content[RingRecord.AGGREGATE] = delta_record(aggregate)
    return Message(content, metadata=Metadata(
        run_id=1, message_id="r1", src_node_id=5, dst_node_id=0, reply_to_message_id="m1",
        group_id="1", created_at=0.0, ttl=60.0, message_type="query.cross_silo"))


def test_the_server_reads_a_ring_reply_or_says_what_is_wrong_with_it() -> None:
    words = np.dtype("<u4")
    good = decode_reply(5, 0, _ring_reply([7], np.arange(4, dtype=np.uint32)), words)
    assert good.status == "ok" and good.failed == (7,)
    np.testing.assert_array_equal(good.aggregate, np.arange(4))
    floats = decode_reply(5, 0, _ring_reply([], np.zeros(4, np.float32)), words)
    assert floats.status == "error" and "expected uint32" in floats.reason
    for bad in (["7"], [True]):
        reply = decode_reply(5, 1, _ring_reply(bad, None), words)
        assert reply.status == "error" and "not a list of node ids" in reply.reason
