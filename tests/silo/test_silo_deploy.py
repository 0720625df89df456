"""Silos as real processes: a SuperLink, SuperNodes, `fedring silo` jobs and `flwr run`.

Three silos: one runs two processes (DDP inside), the others one each. Round 1 aggregates
over the ring of all three, and the server applies exactly the weighted mean of what each
silo would train alone. The last silo is then killed (its whole torchrun job, SIGKILL) as
its SuperNode receives the round-2 message, and round 2 fails once the others give up on it. Before
that, a secure run over the same silos sums masked updates over the ring.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
from silo_helpers import deployed_silos, expected_first_round, flwr_run, kill_silo_in_round_2

from server.store import Store

PROCESSES = (2, 1, 1)  # per silo; three: a secure sum needs secagg.min_survivors = 3
SILOS = len(PROCESSES)
FEDERATION = "fedring-silos"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def silos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A SuperLink, SuperNodes with --isolation process, and a `fedring silo` per node."""
    with deployed_silos(tmp_path_factory.mktemp("silos"), PROCESSES, FEDERATION) as fed:
        yield fed


def _flwr_run(silos: dict[str, Any], db: str, rounds: int,
              extra: str) -> AbstractContextManager[subprocess.Popen]:
    """`flwr run` of a cross-silo run over the silos (killed if it still runs at the end)."""
    overrides = (f"federation.clients={SILOS} federation.min_clients={SILOS} "
                 f"federation.rounds={rounds} federation.round_timeout_s=120 "
                 f"train.local_epochs=1 driver.kind=cross_silo silo.join_timeout_s=10 {extra}")
    return flwr_run(silos, FEDERATION, db, overrides)


def test_real_silos_sum_masked_updates_over_the_ring(silos: dict[str, Any]) -> None:
    """SecAgg+ across the real silos: masked words through the ring, the plain mean out."""
    db = f"sqlite:///{silos['tmp'] / 'secure.db'}"
    with _flwr_run(silos, db, 1, "silo.ring_timeout_s=30 secagg.enabled=true") as run:
        out, _ = run.communicate(timeout=300)
    # `flwr run --stream` exits 0 even when the ServerApp raises: the store says how it went
    assert run.returncode == 0, out[-4000:]

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        model = store.load_checkpoint(info.run_id, round=1)
        [secure] = store.secagg_rounds(info.run_id)
    assert info.config["secagg"]["enabled"] and info.config["driver"]["kind"] == "cross_silo"
    assert [r.status for r in rounds] == ["completed", "completed"], out[-4000:]
    assert rounds[1].metrics["ring_count"] == SILOS
    assert secure["status"] == "completed" and secure["num_survivors"] == SILOS
    initial, expected = expected_first_round(info.config)
    # each silo rounds its weighted update to the fixed-point grid (far below 1e-5 here)
    np.testing.assert_allclose(model.params - initial, expected, atol=1e-5)


def test_real_silos_aggregate_over_the_ring_and_a_killed_silo_fails_the_round(
        silos: dict[str, Any]) -> None:
    db = f"sqlite:///{silos['tmp'] / 'silos.db'}"
    with _flwr_run(silos, db, 2, "silo.ring_timeout_s=3") as run:
        out = kill_silo_in_round_2(silos, run, "train.cross_silo", SILOS - 1)

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        first_model = store.load_checkpoint(info.run_id, round=1)
        updates = {u.client_id: u for _, u in store.updates(info.run_id, round=2)}
    assert info.config["driver"]["kind"] == "cross_silo"
    assert [r.status for r in rounds] == ["completed", "completed", "failed"], out[-4000:]
    first, second = rounds[1:]
    assert first.num_accepted == SILOS and first.metrics["ring_count"] == SILOS
    initial, expected = expected_first_round(info.config)
    np.testing.assert_allclose(first_model.params - initial, expected, atol=1e-5)

    assert second.model_version == first.model_version  # the model is unchanged
    victim = next(cid for cid, u in updates.items() if u.fate == "dropped")
    assert "hung or died" in updates[victim].reason
    others = [u for cid, u in updates.items() if cid != victim]
    assert len(others) == SILOS - 1
    assert all("did not join" in u.reason for u in others), [u.reason for u in others]
