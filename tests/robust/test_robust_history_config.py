"""Configuration of bucketing, centered clipping and the geometric median: bad settings
and too few clients fail at start, naming the key."""

from __future__ import annotations

import pytest

from aggregation.bucketing import Bucketing
from aggregation.centered import CenteredClip, GeometricMedian
from server.config import AggregationConfig
from simulations.config import load_scenario

SMALL = ["federation.rounds=1", "train.local_epochs=1", "federation.checkpoint_every=0"]


def test_keys_build_the_combines():
    cc = AggregationConfig(combine="centered_clip", clip_radius=0.5, clip_iterations=2,
                           f=1).build().combine
    assert (type(cc), cc.radius, cc.iterations, cc.f) == (CenteredClip, 0.5, 2, 1)
    gm = AggregationConfig(combine="geometric_median", gm_nu=1e-3, gm_iterations=5).build()
    assert (type(gm.combine), gm.combine.nu, gm.combine.iterations) == \
        (GeometricMedian, 1e-3, 5)
    b = AggregationConfig(combine="centered_clip", bucketing=2).build(seed=9).combine
    assert type(b) is Bucketing and (b.size, b.seed, type(b.inner)) == (2, 9, CenteredClip)
    assert b.needs_center
    assert type(AggregationConfig(combine="median", bucketing=1).build().combine).__name__ \
        == "CoordinateMedian"  # 1: off
    # centered clipping under secagg: the clients clip, the server takes the mean
    p = AggregationConfig(combine="centered_clip", clip_radius=0.3).build(secure=True)
    assert p.linear and p.client_radius == 0.3 and p.keeps_center


@pytest.mark.parametrize(("overrides", "match"), [
    (["federation.clients=8", "aggregation.combine=centered_clip", "aggregation.f=4"],
     "centered clipping with f=4 needs at least 9 clients per round, got 8"),
    (["federation.clients=6", "aggregation.combine=geometric_median", "aggregation.f=3"],
     "geometric median with f=3 needs at least 7 clients per round, got 6"),
    (["federation.clients=20", "aggregation.combine=krum", "aggregation.f=4",
      "aggregation.bucketing=2"],
     "Krum with f=4 over buckets of 2 needs at least 11 buckets of 2, so at least 21"),
    (["aggregation.combine=mean", "aggregation.bucketing=2"],
     "set aggregation.bucketing = 0"),
    (["aggregation.combine=median", "aggregation.bucketing=-1"],
     "aggregation.bucketing must be >= 0"),
    (["aggregation.combine=centered_clip", "aggregation.clip_radius=-1"],
     "clip_radius must be a finite number >= 0"),
    (["aggregation.combine=centered_clip", "aggregation.clip_iterations=0"],
     "clip_iterations must be >= 1"),
    (["aggregation.combine=geometric_median", "aggregation.gm_nu=0"],
     "gm_nu must be a finite number > 0"),
    (["aggregation.combine=geometric_median", "aggregation.gm_iterations=0"],
     "gm_iterations must be >= 1"),
])
def test_bad_settings_fail_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SMALL, *overrides])


def test_enough_clients_for_buckets_pass():
    cfg = load_scenario("default", [*SMALL, "federation.clients=9",
                                    "aggregation.combine=centered_clip", "aggregation.f=2",
                                    "aggregation.bucketing=2"])  # 5 buckets >= 2f + 1
    assert cfg["aggregation"]["bucketing"] == 2


# -- under secure aggregation ---------------------------------------------------------------
SECURE = [*SMALL, "federation.clients=5", "secagg.enabled=true"]


@pytest.mark.parametrize("combine", ["median", "geometric_median", "krum"])
def test_secagg_refuses_other_non_linear_combines_and_names_client_side_clipping(combine):
    with pytest.raises(ValueError, match="only ever sees the weighted sum") as err:
        load_scenario("default", [*SECURE, f"aggregation.combine={combine}",
                                  "aggregation.f=1"])
    assert "'centered_clip' (each client clips its update around the previous aggregate" \
        in str(err.value)


@pytest.mark.parametrize(("overrides", "match"), [
    ([], "set aggregation.clip_radius > 0"),
    (["aggregation.clip_radius=0.5", "aggregation.bucketing=2"],
     "set aggregation.bucketing = 0"),
    (["aggregation.clip_radius=0.5", "driver.kind=fedbuff", "driver.buffer_size=5"],
     "runs in sync rounds"),
])
def test_client_side_clipping_needs_a_radius_and_sync_rounds(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SECURE, "aggregation.combine=centered_clip", *overrides])


def test_client_side_clipping_is_accepted_with_secagg_and_dp():
    dp = ["aggregation.weight_by=uniform", "dp.clip=0.5", "dp.noise_multiplier=1.0"]
    for mode in ("central", "distributed"):
        cfg = load_scenario("default", [*SECURE, "aggregation.combine=centered_clip",
                                        "aggregation.clip_radius=0.5", *dp,
                                        f"dp.mode={mode}"])
        assert cfg["aggregation"]["combine"] == "centered_clip"
    # without secagg the server runs centered clipping on the updates, which DP refuses
    with pytest.raises(ValueError, match="is not a sum"):
        load_scenario("default", [*SMALL, "aggregation.combine=centered_clip",
                                  "dp.mode=central", *dp])
