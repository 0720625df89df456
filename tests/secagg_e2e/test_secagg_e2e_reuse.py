"""In process, a client's quantized input and masked reply live in reused buffers (no copy
of d words): every round's sum stays exact and replies kept after a round are never
overwritten by later rounds."""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs

from client.protocol.secagg import SecAggKey, SecAggRecord
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
