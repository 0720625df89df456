"""Measured figures (printed, not asserted): run with ``pytest -m slow -s``.

CPU time (``time.thread_time``) is reported next to wall time, because wall time
on a shared machine also counts the time other processes hold the cores.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from privacy.secagg import SecAggClient, SecAggServer, SessionParams, Stage, run_secagg_round
from privacy.secagg.prg import combine, prg_bound

pytestmark = pytest.mark.slow


def _plain_reply(x: np.ndarray) -> tuple[bytearray, float]:
    """What an unmasked client pays to put its vector in a reply: new buffer + copy."""
    start = time.thread_time()
    buf = bytearray(24 + x.nbytes)
    np.frombuffer(buf, dtype=x.dtype, offset=24)[:] = x
    return buf, time.thread_time() - start


@pytest.mark.parametrize("k", [3, 10])
def test_client_cost_vsprg_bound(k):
    dim, n = 1_000_000, k + 1
    rng = np.random.default_rng(k)
    inputs = [rng.integers(0, 1 << 32, dim, dtype=np.uint32) for _ in range(n)]
    totals, masking, plain = [], [], []
    for _ in range(3):
        config = SessionParams.create(range(1, n + 1), dim, k=k, t=k // 2 + 1)
        server = SecAggServer(config)
        clients = {c: SecAggClient(c) for c in config.participants}
        spent = {c: {} for c in clients}
        for c in clients:
            clients[c].set_input(inputs[c - 1])
        outbox = server.start()
        plain_replies = []  # kept alive like the server keeps the masked ones
        masks_at = Stage.SHARE_KEYS if config.merged else Stage.MASKED_INPUT
        while outbox:
            stage = server.stage
            for c, payload in outbox.items():
                start = time.thread_time()
                reply = clients[c].handle(payload)
                spent[c][stage] = time.thread_time() - start
                server.receive(c, reply)
                if stage is masks_at:
                    plain_replies.append(_plain_reply(inputs[c - 1]))
            outbox = server.advance()
        plain.append(np.median([t for _, t in plain_replies]))
        assert server.status.value == "completed"
        np.testing.assert_array_equal(
            server.result(), np.sum(inputs, axis=0, dtype=np.uint64).astype(np.uint32)
        )
        totals.append(np.median([sum(s.values()) for s in spent.values()]))
        masking.append(np.median([s[masks_at] for s in spent.values()]))
    bare = prg_bound(dim, k + 1)
    out = np.zeros(dim, dtype=np.uint32)
    seeds = [(os.urandom(32), 1) for _ in range(k + 1)]
    combined = float("inf")
    for _ in range(5):
        start = time.thread_time()
        combine([inputs[0]], seeds, dim, 32, out=out)
        combined = min(combined, time.thread_time() - start)
    total, mask_stage, unmasked = min(totals), min(masking), min(plain)
    print(
        f"\n[secagg] d=1M k={k}: client CPU {total * 1e3:.2f} ms (masking stage "
        f"{mask_stage * 1e3:.2f} ms), bare (k+1) expand+add {bare * 1e3:.2f} ms, "
        f"ratio {total / bare:.2f}; an unmasked 4 MB reply costs {unmasked * 1e3:.2f} ms "
        f"(ratio beyond it {(total - unmasked) / bare:.2f}); masking into a warm buffer "
        f"{combined * 1e3:.2f} ms (ratio {combined / bare:.2f})"
    )


def test_server_unmasking_with_dropouts_and_full_graph_round():
    n, dim = 100, 100_000
    rng = np.random.default_rng(7)
    inputs = [rng.integers(0, 1 << 32, dim, dtype=np.uint32) for _ in range(n)]
    drop = {c: Stage.MASKED_INPUT for c in range(1, n + 1, 10)}
    for label, k, dropped in (
        ("default k, 10% dropped", None, drop),
        ("full graph, 10% dropped", n - 1, drop),
        ("full graph, no dropout", n - 1, {}),
    ):
        wall, cpu = time.perf_counter(), time.thread_time()
        total, server = run_secagg_round(inputs, k=k, drop=dropped)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        ids = sorted(server.survivors)
        assert len(ids) == n - len(dropped)
        expected = np.sum([inputs[c - 1] for c in ids], axis=0, dtype=np.uint64)
        np.testing.assert_array_equal(total, expected.astype(np.uint32))
        print(
            f"\n[secagg] n=100 d=100k {label} (k={server.config.k}, t={server.config.t}): "
            f"round wall {wall:.2f} s, CPU {cpu:.2f} s; server unmasking "
            f"{server.seconds[Stage.UNMASKING] * 1e3:.0f} ms, server total "
            f"{sum(server.seconds.values()) * 1e3:.0f} ms"
        )
