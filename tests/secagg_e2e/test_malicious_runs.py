"""Malicious-mode secure aggregation in whole runs: ``fedring simulate`` makes the run's PKI
and hands it to the engine; the store records which mode held; a run whose nodes have no
identity fails its rounds with the clients' own reason stored."""

from __future__ import annotations

import json

import numpy as np
import pytest

from server.store import Store
from simulations.apps import run_pki
from simulations.cli import main
from simulations.config import load_scenario
from simulations.report import round_table

SMALL = ["--clients", "4", "--rounds", "2", "--set", "train.local_epochs=1",
         "--set", "data.partitioner=iid", "--set", "secagg.enabled=true"]


def simulate(db: str, *extra: str) -> dict:
    """``fedring simulate ... --json`` in process; its summary line."""
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
        assert main(["simulate", "--db", db, "--json", *SMALL, *extra]) == 0
    return json.loads(lines[-1])


def test_simulate_malicious_reaches_the_semi_honest_model_and_records_the_mode(tmp_path):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    plain = simulate(db)
    lying_proof = simulate(db, "--set", "secagg.security=malicious")
    assert lying_proof["status"] == "completed" and lying_proof["versions"] == 2
    with Store(db) as store:
        a = store.load_checkpoint(plain["run_id"]).params
        b = store.load_checkpoint(lying_proof["run_id"]).params
        np.testing.assert_array_equal(a, b)  # masks cancel exactly: the same sum
        modes = {run: [r["security"] for r in store.secagg_rounds(run)]
                 for run in (plain["run_id"], lying_proof["run_id"])}
        malicious = store.secagg_rounds(lying_proof["run_id"])
        rows = round_table(store.rounds(lying_proof["run_id"]), malicious)
    assert modes == {plain["run_id"]: ["semi_honest"] * 2,
                     lying_proof["run_id"]: ["malicious"] * 2}
    assert all(r["status"] == "completed" and "consistency_check" in r["dropouts"]
               for r in malicious)
    assert [row.get("security") for row in rows] == [None, "malicious", "malicious"]
    assert [row.get("drop@check") for row in rows] == [None, 0, 0]
    with Store(db) as store:  # a semi-honest session has no consistency stage to show
        plain_rows = round_table(store.rounds(plain["run_id"]),
                                 store.secagg_rounds(plain["run_id"]))
    assert [("drop@check" in row, row.get("security")) for row in plain_rows] == [
        (False, None), (False, "semi_honest"), (False, "semi_honest")]


def test_the_pki_is_made_only_for_malicious_secure_runs():
    base = ["federation.clients=3", "secagg.enabled=true"]
    assert run_pki(load_scenario("default", base)) is None
    assert run_pki(load_scenario("default", ["federation.clients=3",
                                             "secagg.security=malicious"])) is None
    pki = run_pki(load_scenario("default", [*base, "secagg.security=malicious"]))
    assert pki is not None and len(pki.identity_pems) == 3


def test_malicious_nodes_without_identity_fail_the_round_with_their_reason(
        run_inprocess, store):
    """What a deployment whose nodes got no ``secagg-identity-key`` sees: every client
    refuses the malicious SETUP, the round aborts, and each refusal is stored."""
    cfg = load_scenario("default", ["federation.clients=4", "federation.rounds=1",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    "secagg.security=malicious"])
    summary = run_inprocess(cfg)
    [row] = store.secagg_rounds(summary["run_id"])
    assert row["status"] == "aborted" and row["security"] == "malicious"
    assert "no identity key" in row["abort_reason"]
    [(rnd, update), *others] = store.updates(summary["run_id"], round=1)
    for _, u in [(rnd, update), *others]:
        assert u.fate == "dropped" and "no identity key" in u.reason
        assert "secagg-identity-key" in u.reason


@pytest.mark.slow
def test_flower_engine_malicious_run_gets_its_pki(db_url, store):
    """Flower's Ray engine: the run's PKI reaches each virtual node's ClientApp."""
    from simulations.cli import run_simulation

    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    "secagg.security=malicious"])
    summary = run_simulation(cfg, engine="flower", db=db_url)
    assert summary["versions"] == 1
    [row] = store.secagg_rounds(summary["run_id"])
    assert (row["status"], row["security"], row["num_survivors"]) == ("completed",
                                                                     "malicious", 3)
