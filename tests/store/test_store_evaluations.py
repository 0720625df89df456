"""The evaluations table: each client's answer in a federated evaluation round, stored
with its round, read back in order, replaced when the round is recorded again and
dropped with the rounds a resume discards."""

from __future__ import annotations

import pytest

from server.store import EvalRecord, Store, UpdateRecord

ANSWERS = [
    EvalRecord("3", "accepted", num_examples=40, loss=0.25, accuracy=0.9),
    EvalRecord("1", "accepted", num_examples=12, loss=0.5, accuracy=0.75, loss_personal=0.125,
               accuracy_personal=0.875),
    EvalRecord("2", "rejected", reason="evaluate reply's 'eval_loss' must be a finite number, "
               "got nan"),
    EvalRecord("4", "dropped", reason="late: no reply within 2 s"),
]


def _round(store: Store, run_id: str, rnd: int, evaluations=()) -> None:
    store.record_round(run_id, round=rnd, model_version=rnd, metrics={"accuracy": 0.5},
                       updates=[UpdateRecord("1", "accepted")], evaluations=evaluations)


def test_round_trip_in_order_per_round(store: Store) -> None:
    run_id = store.create_run(config={}, seed=0)
    _round(store, run_id, 1)
    _round(store, run_id, 2, ANSWERS)
    _round(store, run_id, 3, ANSWERS[:1])
    assert store.evaluations(run_id) == [(2, a) for a in ANSWERS] + [(3, ANSWERS[0])]
    assert store.evaluations(run_id, round=2) == [(2, a) for a in ANSWERS]
    assert store.evaluations(run_id, round=1) == []
    assert [u.client_id for _, u in store.updates(run_id)] == ["1", "1", "1"]  # untouched


def test_recording_a_round_again_replaces_its_evaluations(store: Store) -> None:
    run_id = store.create_run(config={}, seed=0)
    _round(store, run_id, 1, ANSWERS)
    _round(store, run_id, 1, ANSWERS[2:3])
    assert store.evaluations(run_id) == [(1, ANSWERS[2])]
    _round(store, run_id, 1)
    assert store.evaluations(run_id) == []


def test_reopening_a_run_drops_the_evaluations_after_its_checkpoint(store: Store) -> None:
    run_id = store.create_run(config={}, seed=0)
    for rnd in (1, 2, 3):
        _round(store, run_id, rnd, ANSWERS[:2])
    store.reopen_run(run_id, after_round=2)
    assert [r for r, _ in store.evaluations(run_id)] == [1, 1, 2, 2]
    _round(store, run_id, 3, ANSWERS[3:])
    assert store.evaluations(run_id, round=3) == [(3, ANSWERS[3])]


def test_bad_records_are_refused_before_anything_is_written(store: Store) -> None:
    run_id = store.create_run(config={}, seed=0)
    with pytest.raises(TypeError, match="sequence of EvalRecord"):
        _round(store, run_id, 1, ANSWERS[0])
    with pytest.raises(TypeError, match="not an EvalRecord"):
        _round(store, run_id, 1, [UpdateRecord("1", "accepted")])
    with pytest.raises(ValueError, match="num_examples"):
        _round(store, run_id, 1, [EvalRecord("1", "accepted", num_examples=-1)])
    with pytest.raises(TypeError, match="client_id"):
        _round(store, run_id, 1, [EvalRecord(1, "accepted")])  # type: ignore[arg-type]
    assert store.rounds(run_id) == [] and store.evaluations(run_id) == []
