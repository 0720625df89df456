"""A real node that is no silo in a cross-silo run: two `fedring silo` jobs and a SuperNode
serving the plain fedring ClientApp, over a SuperLink and `flwr run`.

The plain node answers train.cross_silo with an error. The silos wait for its ring rank at
the rendezvous for join_timeout_s, longer than ring_timeout_s + 5 s, then report that it did
not join: only it is excluded, and round 2 runs over the two silos.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from silo_helpers import deployed_silos, flwr_run

from server.store import Store

FEDERATION = "fedring-silos-and-a-plain-node"
SILOS = 2  # partitions 0 and 1; the plain node has partition 2
JOIN_S = 15.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with deployed_silos(tmp_path_factory.mktemp("mixed"), (1,) * SILOS, FEDERATION,
                        plain_nodes=1) as deployment:
        yield deployment


def test_only_the_node_that_is_no_silo_is_excluded(fed: dict[str, Any]) -> None:
    db = f"sqlite:///{fed['tmp'] / 'mixed.db'}"
    overrides = (f"federation.clients={SILOS + 1} federation.min_clients={SILOS} "
                 "federation.rounds=2 federation.round_timeout_s=120 train.local_epochs=1 "
                 f"driver.kind=cross_silo silo.join_timeout_s={JOIN_S} silo.ring_timeout_s=3")
    with flwr_run(fed, FEDERATION, db, overrides) as run:
        out, _ = run.communicate(timeout=400)
    assert run.returncode == 0, out[-4000:]

    with Store(db) as store:
        [info] = store.list_runs()
        rounds = store.rounds(info.run_id)
        first = {u.client_id: u for _, u in store.updates(info.run_id, round=1)}
        second = {u.client_id: u for _, u in store.updates(info.run_id, round=2)}
    assert [r.status for r in rounds] == ["completed", "failed", "completed"], out[-4000:]
    assert rounds[1].num_replies == SILOS + 1 and rounds[1].metrics["ring_excluded"] == 1
    [plain] = [cid for cid, u in first.items() if "silo error" in (u.reason or "")]
    assert first[plain].fate == "rejected"
    silos = {cid for cid in first if cid != plain}
    assert all("did not join" in first[cid].reason for cid in silos), out[-4000:]
    assert set(second) == silos and all(u.fate == "accepted" for u in second.values())
    assert info.summary["status"] == "completed" and info.summary["versions"] == 1
