"""Gossip among real silos: a SuperLink, SuperNodes, `fedring silo` jobs and `flwr run`.

Three silos gossip, the first of two processes (DDP inside, every rank training on the
partition less the held-out split), the others of one. In round 2 the last silo's whole
torchrun job is killed (SIGKILL) as its SuperNode receives the message. Round 2 fails
once the others give up on it at the rendezvous, the dead silo is excluded, and round 3
runs on a topology of the two left, so the run completes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from silo_helpers import deployed_silos, flwr_run, kill_silo_in_round_2

from server.store import Store
from simulations.task import ScenarioTask

PROCESSES = (2, 1, 1)  # per silo
SILOS = len(PROCESSES)
FEDERATION = "fedring-gossip"

pytestmark = pytest.mark.slow


def test_a_killed_silo_is_dropped_from_the_next_topology_and_the_run_finishes(
        tmp_path: Path) -> None:
    with deployed_silos(tmp_path, PROCESSES, FEDERATION) as silos:
        db = f"sqlite:///{silos['tmp'] / 'gossip.db'}"
        overrides = (f"federation.clients={SILOS} federation.min_clients=2 "
                     "federation.rounds=3 federation.round_timeout_s=120 train.local_epochs=1 "
                     "driver.kind=gossip silo.join_timeout_s=10 silo.ring_timeout_s=3")
        with flwr_run(silos, FEDERATION, db, overrides) as run:
            out = kill_silo_in_round_2(silos, run, "train.gossip", SILOS - 1)

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        updates: dict[int, dict[str, Any]] = {
            r: {u.client_id: u for _, u in store.updates(info.run_id, round=r)}
            for r in (1, 2, 3)}
    assert info.status == "completed", out[-4000:]
    assert [r.status for r in rounds] == ["completed", "completed", "failed", "completed"]
    first, second, third = rounds[1:]
    assert first.metrics["gossip_silos"] == SILOS and 0 <= first.metrics["accuracy"] <= 1
    assert first.metrics["consensus_distance"] > 0
    assert all(0 <= u.metrics["heldout_acc"] <= 1 for u in updates[1].values())
    task = ScenarioTask.from_config(info.config)  # silos train on their partition less 20%
    examples = sum(len(task.partition(pid)[1]) + len(task.client_test(pid)[1])
                   for pid in range(SILOS))
    assert sum(u.num_examples + u.metrics["heldout_examples"]
               for u in updates[1].values()) == examples
    assert all(u.metrics["heldout_examples"] > 0 for u in updates[1].values())
    victim = next(cid for cid, u in updates[2].items() if u.fate == "dropped")
    assert "hung or died" in updates[2][victim].reason
    assert third.metrics["gossip_silos"] == SILOS - 1 and third.num_accepted == SILOS - 1
    assert victim not in updates[3] and len(updates[3]) == SILOS - 1
    assert second.model_version == first.model_version  # the failed round changed nothing
