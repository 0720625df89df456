"""The same seeds give the same models: every round kind, run in process, ends with the
model and the round figures recorded in ``golden/`` (a refactor must not change them).

On a machine like the one that recorded them (same CPU model and vector capability, torch
and NumPy) the models must match bit for bit; elsewhere float kernels may round
differently, so they must match to 1e-6 (1e-5 under secure aggregation: one fixed-point
quantum). Record again, after a change that is meant to change results, with
``python -m tests.architecture.test_same_models``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario

GOLDEN = Path(__file__).parent / "golden"
# The recordings trained on the process's threads (engine.threads = 0), before "auto" (one
# thread for small models) became the default: the round kinds' logic is what they guard.
BASE = ["federation.clients=4", "federation.rounds=2", "train.local_epochs=1",
        "engine.threads=0"]
KINDS = {
    "sync": [],
    "sync_robust": ["aggregation.combine=centered_clip", "aggregation.server_opt=fedavgm",
                    "federation.evaluate_fraction=1"],
    "secure": ["secagg.enabled=true"],
    "fedbuff": ["driver.kind=fedbuff", "driver.buffer_size=3"],
    "secure_fedbuff": ["driver.kind=fedbuff", "driver.buffer_size=3", "secagg.enabled=true"],
    "cross_silo": ["driver.kind=cross_silo"],
    "secure_cross_silo": ["driver.kind=cross_silo", "secagg.enabled=true"],
    "gossip": ["driver.kind=gossip"],
}


def machine() -> dict[str, str]:
    """What decides whether float kernels round alike."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"arch": platform.machine(), "cpu": model, "torch": torch.__version__,
            "numpy": np.__version__,
            # the kernels torch dispatches to: one model name (a virtual "AMD EPYC") can
            # stand for CPUs with and without AVX-512, which round differently
            "capability": torch.backends.cpu.get_cpu_capability()}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def figures(kind: str, db: str) -> tuple[np.ndarray | None, list[dict[str, float]]]:
    """The final checkpoint's parameters (None without a global model: gossip) and each
    round's metrics but the timings."""
    summary = run_simulation(load_scenario("default", BASE + KINDS[kind]),
                             engine="inprocess", db=db)
    with Store(db) as store:
        ckpt = store.load_checkpoint(summary["run_id"])
        rounds = [{k: v for k, v in r.metrics.items() if not k.endswith("_s")}
                  for r in store.rounds(summary["run_id"])]
    return (None if ckpt is None else ckpt.params), rounds


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_round_kind_gives_the_recorded_model(kind, tmp_path):
    params, rounds = figures(kind, f"sqlite:///{tmp_path / 'runs.db'}")
    recorded = json.loads((GOLDEN / f"{kind}.json").read_text())
    exact = recorded["machine"] == machine()
    assert [sorted(r) for r in rounds] == [sorted(r) for r in recorded["rounds"]]
    for got, want in zip(rounds, recorded["rounds"], strict=True):
        for key, value in want.items():
            assert got[key] == (value if exact else pytest.approx(value, rel=1e-6, abs=1e-9)), \
                (kind, key)
    if recorded["params"] is None:
        assert params is None
        return
    want = np.load(GOLDEN / recorded["params"])
    if exact:
        assert np.array_equal(params, want), f"{kind}: the model changed"
    else:
        # a secure sum is fixed point: an update that rounds differently in its last float
        # bit can land one quantum (about 1.7e-6 here) away
        atol = 1e-5 if "secure" in kind else 1e-6
        np.testing.assert_allclose(params, want, rtol=0, atol=atol, err_msg=kind)


def record(kinds: list[str]) -> None:
    import tempfile

    GOLDEN.mkdir(exist_ok=True)
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            params, rounds = figures(kind, f"sqlite:///{tmp}/runs.db")
        name = None
        if params is not None:
            name = f"{kind}.npy"
            np.save(GOLDEN / name, params)
        (GOLDEN / f"{kind}.json").write_text(json.dumps(
            {"machine": machine(), "params": name, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    record(sys.argv[1:] or sorted(KINDS))
