"""Secure aggregation on Flower's simulation engine: same dropouts, model and bytes as in
process."""

from __future__ import annotations

import numpy as np
import pytest

import server.compression
from client.protocol.secagg import dropout_stage
from simulations.apps import build_task
from simulations.cli import run_simulation
from simulations.config import load_scenario


@pytest.mark.slow
def test_flower_engine_secure_run_with_dropouts_matches_the_inprocess_engine(db_url, store):
    n, fraction = 4, 0.3
    # a seed whose round 1 loses exactly one client after it sent its masked input
    seed = next(s for s in range(200)
                if sum(dropout_stage(s, 1, pid, fraction, "unmasking", n) is not None
                       for pid in range(n)) == 1)
    cfg = load_scenario("default", [f"federation.clients={n}", "federation.rounds=1",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    f"secagg.dropout={fraction}",
                                    'secagg.dropout_stage="unmasking"'],
                        values={"seed": seed})
    a = run_simulation(cfg, engine="inprocess", db=db_url)
    b = run_simulation(cfg, engine="flower", db=db_url)
    assert a["versions"] == b["versions"] == 1
    ra, rb = store.secagg_rounds(a["run_id"])[0], store.secagg_rounds(b["run_id"])[0]
    assert ra["status"] == rb["status"] == "completed"
    assert len(ra["dropouts"]["unmasking"]) == len(rb["dropouts"]["unmasking"]) == 1
    assert ra["num_survivors"] == rb["num_survivors"] == n  # its masked input still counts
    # Flower's node ids differ (so does the graph), but the sum of the same inputs does not
    pa = store.load_checkpoint(a["run_id"]).params
    pb = store.load_checkpoint(b["run_id"]).params
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_flower_engine_secure_randk_matches_the_inprocess_engine(db_url, store, monkeypatch):
    # one run number for both runs, so that both draw each round's pattern alike
    monkeypatch.setattr(server.compression, "session_number", lambda run_id: 12345)
    cfg = load_scenario("default", ["federation.clients=4", "federation.rounds=2",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    "compression.kind=topk", "compression.shared_pattern=true",
                                    "compression.fraction=0.1"])
    a = run_simulation(cfg, engine="inprocess", db=db_url)
    b = run_simulation(cfg, engine="flower", db=db_url)
    assert a["versions"] == b["versions"] == 2
    pa = store.load_checkpoint(a["run_id"]).params
    pb = store.load_checkpoint(b["run_id"]).params
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)
    start = build_task(cfg).initial_params()[0]
    moved = np.count_nonzero(pa != start)
    assert 0 < moved < 0.25 * pa.size  # two rounds of 10% patterns, not a dense update
    # k + 1 masked words per client and round, on either engine
    up = [[r.metrics["bytes_up"] for r in store.rounds(run["run_id"]) if r.metrics.get("bytes_up")]
          for run in (a, b)]
    assert len(up[0]) == 2 and up[0] == up[1]
    assert max(up[0]) < 4 * pa.size  # all four uploads and keys: less than one dense vector
