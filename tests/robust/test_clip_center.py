"""Centered clipping around the server's momentum buffer (``aggregation.clip_center =
"momentum"``): the kept centre is ``c <- beta c + (1 - beta) aggregate`` from 0, which is
``(1 - beta)`` times FedAvgM's buffer ``m <- beta m + aggregate``."""

from __future__ import annotations

import numpy as np
import pytest

from aggregation.update import Update
from server.config import AggregationConfig
from simulations.config import load_scenario


def aggregate_round(pipe, params, rows, version):
    agg = pipe.open_round(dim=params.shape[0], version=version)
    center = agg.combine.center  # what this round clips around
    for i, r in enumerate(rows):
        assert agg.submit(Update(f"c{i}", np.asarray(r, np.float32), 10, version)).accepted
    return pipe.apply(params, agg.finish(), total_weight=agg.total_weight,
                      count=agg.num_accepted), center


def test_the_centre_is_the_scaled_momentum_buffer():
    rng = np.random.default_rng(0)
    pipe = AggregationConfig(combine="centered_clip", f=1, server_opt="fedavgm",
                             momentum=0.8, clip_center="momentum").build()
    params = np.zeros(6, np.float32)
    kept = None
    for version in range(4):
        params, center = aggregate_round(pipe, params, rng.normal(size=(5, 6)), version)
        if kept is None:
            assert center is None  # the first round clips around 0
        else:
            np.testing.assert_array_equal(center, kept)  # each round: the kept centre
        np.testing.assert_allclose(pipe.center, 0.2 * pipe.server_opt.m, rtol=1e-5,
                                   atol=1e-7)
        kept = pipe.center.copy()


def test_the_default_centre_is_the_last_aggregate():
    rng = np.random.default_rng(1)
    pipe = AggregationConfig(combine="centered_clip", f=1, server_opt="fedavgm",
                             momentum=0.8).build()
    params = np.zeros(6, np.float32)
    for version in range(3):
        agg = pipe.open_round(dim=6, version=version)
        for i, r in enumerate(rng.normal(size=(5, 6))):
            agg.submit(Update(f"c{i}", r.astype(np.float32), 10, version))
        out = agg.finish()
        params = pipe.apply(params, out)
        np.testing.assert_array_equal(pipe.center, out)


@pytest.mark.parametrize(("keys", "match"), [
    ({"combine": "centered_clip", "clip_center": "buffer"},
     "aggregation.clip_center 'buffer' is unknown; choose one of: aggregate, momentum"),
    ({"combine": "centered_clip", "clip_center": "momentum"},
     "'fedavg' does not keep: set aggregation.server_opt = 'fedavgm'"),
    ({"combine": "median", "clip_center": "momentum", "server_opt": "fedavgm"},
     "aggregation.clip_center is read by centered clipping only"),
])
def test_refused_where_it_cannot_work(keys, match):
    with pytest.raises(ValueError, match=match):
        AggregationConfig(**keys)


def test_under_secagg_the_clients_clip_around_the_same_centre():
    pipe = AggregationConfig(combine="centered_clip", clip_radius=1.0, server_opt="fedavgm",
                             momentum=0.5, clip_center="momentum").build(secure=True)
    params = np.zeros(3, np.float32)
    params = pipe.apply(params, np.array([2.0, 0.0, 0.0], np.float32))
    params = pipe.apply(params, np.array([0.0, 4.0, 0.0], np.float32))
    center, radius = pipe.client_center(3)
    np.testing.assert_allclose(center, [0.5, 2.0, 0.0])  # 0.5 (0.5 [2, 0, 0]) + 0.5 [0, 4, 0]
    assert radius == 1.0


def test_a_scenario_reads_the_key():
    cfg = load_scenario("default", [
        "federation.rounds=1", "aggregation.combine=centered_clip",
        "aggregation.server_opt=fedavgm", "aggregation.clip_center=momentum"])
    assert cfg["aggregation"]["clip_center"] == "momentum"
