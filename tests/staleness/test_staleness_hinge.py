"""The hinge staleness function past its knee b, for several b, against values worked out
by hand: s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1) (Xie et al. 2019)."""

from __future__ import annotations

import numpy as np
import pytest
from staleness_helpers import scenario

from aggregation import Hinge, Update
from server.config import AggregationConfig
from server.driver_config import DriverConfig

# (a, b, tau, s(tau)), each s worked out by hand; every b has a tau at b and beyond it.
HAND = [
    (1.0, 0, 0, 1.0), (1.0, 0, 1, 1 / 2), (1.0, 0, 3, 1 / 4),
    (2.0, 2, 2, 1.0), (2.0, 2, 3, 1 / 3), (2.0, 2, 5, 1 / 7),
    (0.5, 5, 5, 1.0), (0.5, 5, 6, 2 / 3), (0.5, 5, 9, 1 / 3),
    (10.0, 8, 7, 1.0), (10.0, 8, 8, 1.0), (10.0, 8, 9, 1 / 11), (10.0, 8, 12, 1 / 41),
]


@pytest.mark.parametrize(("a", "b", "tau", "s"), HAND)
def test_hinge_beyond_b(a: float, b: int, tau: int, s: float) -> None:
    assert Hinge(a=a, b=b)(tau) == pytest.approx(s, rel=1e-12)


@pytest.mark.parametrize("b", sorted({b for _, b, _, _ in HAND}))
def test_configured_hinge_weights_each_update_by_its_own_b(b: int) -> None:
    """From the scenario keys to the pipeline's weights: driver.staleness_b reaches s(tau)."""
    cases = [(a, tau, s) for a, bb, tau, s in HAND if bb == b]
    a = cases[0][0]
    cfg = scenario("driver.staleness=hinge", f"driver.staleness_a={a}",
                   f"driver.staleness_b={b}")
    assert cfg["driver"]["staleness_b"] == b
    staleness = DriverConfig(**cfg["driver"]).staleness_config()
    pipeline = AggregationConfig(**cfg["aggregation"]).build(staleness=staleness)
    version = 20
    agg = pipeline.open_round(dim=2, version=version)
    for i, (_, tau, s) in enumerate(cases):
        verdict = agg.submit(Update(f"c{i}", np.ones(2, np.float32), 7, version - tau))
        assert verdict.accepted and verdict.staleness == tau
        assert verdict.weight == pytest.approx(7 * s, rel=1e-12), (a, b, tau)
