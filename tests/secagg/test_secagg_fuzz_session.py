"""Corrupted replies in a live round never crash the server session."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privacy.secagg import (
    ProtocolError,
    SecAggClient,
    SecAggServer,
    SessionParams,
    Stage,
    Status,
)
from privacy.secagg.stages import MsgType

N, DIM = 5, 8
INPUTS = [np.arange(DIM, dtype=np.uint32) * (c + 1) for c in range(N)]
STAGES = [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stage=st.sampled_from(STAGES),
    victim=st.integers(1, N),
    pos=st.integers(0, 10_000),
    value=st.integers(0, 255),
)
def test_one_corrupted_reply_is_rejected_or_harmless(stage, victim, pos, value):
    config = SessionParams.create(range(1, N + 1), DIM, k=4, t=3)
    server = SecAggServer(config)
    clients = {c: SecAggClient(c) for c in config.participants}
    for c in clients:
        clients[c].set_input(INPUTS[c - 1])
    silent: set[int] = set()
    vector_hit = False  # merged flow: a masked vector sent with the shares was changed
    outbox = server.start()
    while server.status is Status.RUNNING:
        current = server.stage
        for c, payload in outbox.items():
            if c in silent:
                continue
            try:
                reply = clients[c].handle(payload)
            except ProtocolError:
                silent.add(c)
                continue
            if current == stage and c == victim:
                reply = bytearray(reply)
                reply[pos % len(reply)] = value
                vector_hit = pos % len(reply) >= len(reply) - 4 * DIM and \
                    reply[3] == MsgType.SHARES_AND_INPUT
            assert isinstance(server.receive(c, bytes(reply)), bool)
        outbox = server.advance()
    assert server.status in (Status.COMPLETED, Status.ABORTED)
    if server.status is Status.COMPLETED and stage in (Stage.SHARE_KEYS, Stage.UNMASKING) \
            and not vector_hit:
        # ciphertexts are authenticated and shares checked: the sum is right or absent
        expected = sum(INPUTS[c - 1].astype(np.uint64) for c in server.survivors)
        np.testing.assert_array_equal(server.result(), expected.astype(np.uint32))
