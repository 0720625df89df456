"""The recommended secure setting's server step: the clients clip around ``(1 - beta)``
times FedAvgM's buffer, and the server steps ``lr`` times that buffer (``server_lr`` 2);
the buffer and the centre stay in units of the aggregate, whatever the step."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from server.config import AggregationConfig
from simulations.config import load_scenario

ROOT = Path(__file__).resolve().parents[2]
LR, BETA = 2.0, 0.6
SECURE = ["federation.clients=5", "train.local_epochs=1", "secagg.enabled=true",
          "aggregation.combine=centered_clip", "aggregation.weight_by=uniform",
          "aggregation.server_opt=fedavgm", f"aggregation.momentum={BETA}",
          f"aggregation.server_lr={LR}", "aggregation.clip_center=momentum"]


def test_the_step_is_lr_times_the_buffer_and_the_centre_is_not_scaled():
    pipe = AggregationConfig(combine="centered_clip", clip_radius=1.0, server_opt="fedavgm",
                             momentum=BETA, server_lr=LR, clip_center="momentum",
                             weight_by="uniform").build(secure=True)
    a1 = np.array([1.0, 0.0, 0.0], np.float32)
    a2 = np.array([0.0, 2.0, 0.0], np.float32)
    params = pipe.apply(np.zeros(3, np.float32), a1.copy())
    np.testing.assert_allclose(params, LR * a1)
    params = pipe.apply(params, a2.copy())
    m = BETA * a1 + a2
    np.testing.assert_allclose(pipe.server_opt.m, m, rtol=1e-6)
    np.testing.assert_allclose(params, LR * a1 + LR * m, rtol=1e-6)
    center, radius = pipe.client_center(3)
    np.testing.assert_allclose(center, (1 - BETA) * m, rtol=1e-6)  # not LR times it
    assert radius == 1.0


def test_a_secure_run_steps_twice_the_buffer_the_clients_clip_around(run_inprocess, store):
    """Two SecAgg+ rounds: the model moves ``lr`` times the buffer; the checkpoint keeps
    the buffer and the centre, both in units of the mean the clients sent."""
    radius = 0.05
    models: list[np.ndarray] = []
    cfg = load_scenario("default", [*SECURE, "federation.rounds=2",
                                    f"aggregation.clip_radius={radius}",
                                    "federation.checkpoint_every=1"])
    summary = run_inprocess(cfg, models=models)
    assert summary["status"] == "completed" and len(models) == 3
    a1 = (models[1] - models[0]).astype(np.float64) / LR  # the first mean, centred on 0
    quantum = 1e-3  # the fixed-point error of 5 clients' sum, far below the radius here
    assert 0 < np.linalg.norm(a1) <= radius + quantum
    m2 = (models[2] - models[1]).astype(np.float64) / LR
    a2 = m2 - BETA * a1
    center1 = (1 - BETA) * a1  # what round 2's clients clipped around
    assert np.linalg.norm(a2 - center1) <= radius + quantum
    state = store.load_checkpoint(summary["run_id"]).state["pipeline"]
    np.testing.assert_allclose(state["server_opt"]["m"], m2, atol=1e-6)
    np.testing.assert_allclose(state["center"], BETA * center1 + (1 - BETA) * a2, atol=1e-6)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("server_lr", 0, r"server lr must be > 0, got 0\.0: set aggregation\.server_lr"),
    ("server_lr", -2, r"server lr must be > 0, got -2\.0: set aggregation\.server_lr"),
    ("momentum", 1, r"momentum must be in \[0, 1\), got 1\.0: set aggregation\.momentum"),
])
def test_a_bad_step_fails_at_start_naming_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_scenario("default", [*SECURE, "aggregation.clip_radius=1",
                                  f"aggregation.{key}={value}"])


def test_the_documented_secure_command_is_the_benchmarked_setting():
    """docs/ROBUSTNESS.md's recommended secure command sets exactly the keys of the
    benchmark's ``cc_secagg_ml`` cell (the radius is the seed's own there)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from robustness import COMBINES

    text = (ROOT / "docs" / "ROBUSTNESS.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S)
              if "clip_center=momentum" in b and "secagg.enabled=true" in b]
    assert len(blocks) == 1
    documented = dict(kv.split("=", 1) for kv in re.findall(r"--set (\S+)", blocks[0]))
    documented.pop("aggregation.clip_radius")
    cell = {k: str(v).lower() for k, v in COMBINES["cc_secagg_ml"].items()}
    assert documented == cell
