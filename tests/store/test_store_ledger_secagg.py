"""The privacy ledger and secure-round records: round trip, re-recording, resume."""

from __future__ import annotations

import math

import numpy as np

from server.store import Store, UpdateRecord

LEDGER = {"mode": "central", "accountant": "rdp", "delta": 1e-5, "noise_multiplier": 1.1,
          "clip": 0.5, "sampling_rate": 0.1}


def _secure(store: Store, run_id: str, rnd: int, **extra) -> None:
    store.record_secagg_round(
        run_id, round=rnd, status="completed", k=4, t=3, participants=[1, 2, 3, 4],
        dropouts={"unmask": [4]}, survivors=[1, 2, 3], rejected={5: "bad ciphertext"},
        seconds={"share": 0.25, "unmask": math.nan}, **extra)


def test_ledger_round_trip_and_re_record(store: Store):
    run_id = store.create_run(config={}, seed=0)
    store.record_privacy(run_id, round=1, epsilon=0.5, epsilon_model=0.2,
                         protects_against="server", relation="zero-out",
                         epsilon_replace_one=1.5, relation_model="replace-one", **LEDGER)
    store.record_privacy(run_id, round=2, epsilon=0.9, **LEDGER)
    store.record_privacy(run_id, round=2, epsilon=1.0, **LEDGER)  # replaces round 2
    first, second = store.privacy_ledger(run_id)
    assert first == {"round": 1, "epsilon": 0.5, "epsilon_model": 0.2,
                     "protects_against": "server", "relation": "zero-out",
                     "epsilon_replace_one": 1.5, "relation_model": "replace-one", **LEDGER}
    assert second == {"round": 2, "epsilon": 1.0, "epsilon_model": None,
                      "protects_against": None, "relation": None,
                      "epsilon_replace_one": None, "relation_model": None, **LEDGER}


def test_secure_round_round_trip_and_re_record(store: Store):
    run_id = store.create_run(config={}, seed=0)
    _secure(store, run_id, 1)
    _secure(store, run_id, 1, excluded={2: "late"})  # replaces round 1
    [row] = store.secagg_rounds(run_id)
    seconds = row.pop("seconds")
    assert seconds["share"] == 0.25 and math.isnan(seconds["unmask"])
    assert row == {"round": 1, "status": "completed", "k": 4, "t": 3, "num_participants": 4,
                   "num_survivors": 3, "participants": ["1", "2", "3", "4"],
                   "dropouts": {"unmask": ["4"]}, "survivors": ["1", "2", "3"],
                   "rejected": {"5": "bad ciphertext"}, "excluded": {"2": "late"},
                   "abort_reason": None, "security": "semi_honest"}


def test_reopen_forgets_everything_after_the_checkpoint(store: Store):
    run_id = store.create_run(config={}, seed=0)
    for rnd in (1, 2, 3):
        store.record_round(run_id, round=rnd, model_version=rnd,
                           updates=[UpdateRecord(f"c{rnd}", "accepted")])
        store.record_privacy(run_id, round=rnd, epsilon=float(rnd), **LEDGER)
        _secure(store, run_id, rnd)
    store.save_checkpoint(run_id, round=2, model_version=2,
                          params=np.zeros(2, np.float32), state={})
    store.finish_run(run_id, status="failed")
    store.reopen_run(run_id, after_round=2)
    assert store.get_run(run_id).status == "running"
    assert [r.round for r in store.rounds(run_id)] == [1, 2]
    assert [(rnd, u.client_id) for rnd, u in store.updates(run_id)] == [(1, "c1"), (2, "c2")]
    assert [e["round"] for e in store.privacy_ledger(run_id)] == [1, 2]
    assert [s["round"] for s in store.secagg_rounds(run_id)] == [1, 2]
    assert store.load_checkpoint(run_id).round == 2
