"""In process, a client's quantized input and masked reply live in reused buffers (no copy
of d words): every round's sum stays exact and replies kept after a round are never
overwritten by later rounds."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs

from client.protocol.keys import NodeConfigKey
from client.protocol.secagg import SecAggKey, SecAggRecord
from privacy.secagg.messages import MsgType, read_header
from privacy.secagg.quantize import error_bound
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid

N, DIM = 5, 70_000  # inputs and replies of 280 kB: large enough to be pooled


def test_rounds_in_process_reuse_buffers_but_never_one_still_referenced():
    inputs = synthetic_inputs(N, DIM)
    app = synthetic_app(inputs)
    kept, copies = [], []

    def keeping(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        record = reply.content.get(SecAggRecord.VECTOR) if reply.has_content() else None
        if record is not None:  # the MASKED_INPUT reply: kept for good
            kept.append(record[SecAggKey.VECTOR].data)
            copies.append(bytes(record[SecAggKey.VECTOR].data))
        return reply

    grid = InProcessGrid(keeping, N)  # type: ignore[arg-type]
    settings = SecAggScenarioConfig(enabled=True, clip_range=1.0, max_weight=100.0)
    weights = [min(e, 100.0) for _, e in inputs.values()]  # examples, capped at max_weight
    total = sum(w * np.clip(d.astype(np.float64), -1.0, 1.0)
                for w, (d, _) in zip(weights, inputs.values(), strict=True))
    for rnd in (1, 2, 3):
        arrays, config = empty_model()
        session = SecAggSession(grid, settings, "examples", 3, 5.0, 0.001)
        out = session.run(list(inputs), rnd, TrainStart(arrays, config, DIM))
        assert out.status == "completed", out.abort_reason
        bound = error_bound(N, out.scale, "nearest") * 1.01
        np.testing.assert_allclose(out.weighted_sum, total, rtol=0, atol=bound)
        assert abs(out.total_weight - sum(weights)) <= bound
    assert len(kept) == 3 * N
    assert all(isinstance(data, memoryview) for data in kept)  # shared, not copied
    assert [bytes(data) for data in kept] == copies


@pytest.mark.parametrize("one_object_bytes", [1 << 30, 1024])
def test_outside_the_in_process_engine_a_small_masked_vector_is_one_flower_object(
        monkeypatch, one_object_bytes):
    """Outside the in-process engine a masked vector up to ONE_OBJECT_BYTES travels as the
    protocol record's bytes (fewer Flower objects to move), a larger one as an Array; the sum
    is exact either way."""
    import client.secure_client as secure_client

    monkeypatch.setattr(secure_client, "ONE_OBJECT_BYTES", one_object_bytes)
    n, dim = 4, 2_000
    inputs = synthetic_inputs(n, dim)
    app = synthetic_app(inputs)
    kinds: list[str] = []

    def as_a_supernode(msg: Message, context: Context) -> Message:
        context.node_config[NodeConfigKey.IN_PROCESS] = False
        reply = app(msg, context)
        if reply.has_content() and SecAggRecord.VECTOR in reply.content:
            kinds.append("array")
        elif reply.has_content():
            record = reply.content[SecAggRecord.PROTOCOL]
            kind = read_header(record[SecAggKey.MSG]).kind
            if kind in (MsgType.SHARES_AND_INPUT, MsgType.MASKED_INPUT):
                kinds.append("bytes")
        return reply

    grid = InProcessGrid(as_a_supernode, n)  # type: ignore[arg-type]
    settings = SecAggScenarioConfig(enabled=True, clip_range=1.0, max_weight=100.0)
    weights = [min(e, 100.0) for _, e in inputs.values()]
    total = sum(w * np.clip(d.astype(np.float64), -1.0, 1.0)
                for w, (d, _) in zip(weights, inputs.values(), strict=True))
    arrays, config = empty_model()
    out = SecAggSession(grid, settings, "examples", 3, 5.0, 0.001).run(
        list(inputs), 1, TrainStart(arrays, config, dim))
    assert out.status == "completed", out.abort_reason
    bound = error_bound(n, out.scale, "nearest") * 1.01
    np.testing.assert_allclose(out.weighted_sum, total, rtol=0, atol=bound)
    assert kinds == ["bytes" if one_object_bytes > 4 * (dim + 8) else "array"] * n
