"""Store round trips on every configured database (SQLite file; PostgreSQL if given)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, text, update

from server.store import (
    Checkpoint,
    CorruptCheckpoint,
    RoundInfo,
    Store,
    StoreError,
    UnknownRun,
    UpdateRecord,
    mask_url,
)
from server.store.models import CheckpointRow

CONFIG = {
    "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
    "train": {"lr": 0.05, "epochs": 1},
    "federation": {"num_clients": 20, "rounds": 3},
    "driver": {"kind": "sync", "deadline_s": math.inf},
    "dp": {"enabled": False, "noise": None},
    "tags": ["a", "b"],
}


def updates_for_round(rnd: int) -> list[UpdateRecord]:
    return [
        UpdateRecord(
            "c0",
            "accepted",
            num_examples=120,
            base_version=rnd - 1,
            staleness=0,
            norm=1.25,
            weight=0.5,
            metrics={"train_loss": 0.7, "num_batches": 4},
        ),
        UpdateRecord(
            "c1",
            "accepted",
            num_examples=np.int64(80),
            base_version=rnd - 1,
            staleness=np.int32(0),
            norm=np.float32(0.5),
            weight=np.float64(0.5),
            metrics={"train_loss": np.float32(0.25)},
        ),
        UpdateRecord("c2", "rejected", reason="non-finite values", norm=math.nan),
        UpdateRecord("c3", "dropped", reason="deadline passed"),
    ]


# ---- runs


def test_create_and_get_run(store: Store):
    before = datetime.now(UTC)
    run_id = store.create_run(config=CONFIG, seed=1234, name="digits-fedavg")
    assert re.fullmatch(r"r[0-9a-f]{12}", run_id)
    info = store.get_run(run_id)
    assert info.run_id == run_id
    assert info.name == "digits-fedavg"
    assert info.status == "running"
    assert info.seed == 1234
    assert info.config == CONFIG  # inf and None included
    assert info.summary is None and info.finished_at is None
    assert info.num_rounds == 0
    assert info.created_at.tzinfo is not None
    assert before - timedelta(seconds=1) <= info.created_at <= datetime.now(UTC)


def test_finish_run(store: Store):
    run_id = store.create_run(config={}, seed=0)
    store.finish_run(
        run_id,
        status="completed",
        summary={"accuracy": np.float32(0.75), "epsilon": math.inf, "rounds": 3, "best": None},
    )
    info = store.get_run(run_id)
    assert info.status == "completed"
    assert info.finished_at is not None and info.finished_at >= info.created_at
    assert info.summary == {"accuracy": 0.75, "epsilon": math.inf, "rounds": 3, "best": None}
    store.finish_run(run_id, status="failed")  # no summary: NULL, not JSON null
    assert store.get_run(run_id).summary is None


@pytest.mark.parametrize("status", ["running", "done", "COMPLETED", ""])
def test_finish_run_rejects_bad_status(store: Store, status: str):
    run_id = store.create_run(config={}, seed=0)
    with pytest.raises(ValueError, match="must be one of completed, failed, stopped"):
        store.finish_run(run_id, status=status)
    assert store.get_run(run_id).status == "running"


def test_list_runs_newest_first(store: Store):
    assert store.list_runs() == []
    ids = [store.create_run(config={"i": i}, seed=i, name=f"run{i}") for i in range(5)]
    store.record_round(ids[1], round=0, model_version=0)  # the initial model: no round
    store.record_round(ids[1], round=1, model_version=1)
    store.record_round(ids[1], round=2, model_version=2)
    assert store.get_run(ids[1]).num_rounds == 2
    runs = store.list_runs()
    assert [r.run_id for r in runs] == ids[::-1]
    assert [r.num_rounds for r in runs] == [0, 0, 0, 2, 0]
    assert [r.config for r in runs] == [{"i": i} for i in reversed(range(5))]


def test_seed_and_config_validation(store: Store):
    with pytest.raises(ValueError, match="64 bits"):
        store.create_run(config={}, seed=2**64)
    with pytest.raises(TypeError, match="seed"):
        store.create_run(config={}, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"config\.bad"):
        store.create_run(config={"bad": {1, 2}}, seed=0)
    with pytest.raises(TypeError, match="keys must be str"):
        store.create_run(config={1: "x"}, seed=0)
    assert store.list_runs() == []
    big = store.create_run(config={"arr": np.arange(3), "t": (1, 2)}, seed=-(2**63))
    info = store.get_run(big)
    assert info.seed == -(2**63)
    assert info.config == {"arr": [0, 1, 2], "t": [1, 2]}


def test_json_columns_hold_strict_json(store: Store, store_url: str):
    """PostgreSQL's json refuses NaN/Infinity tokens: they are stored as strings."""
    run_id = store.create_run(config={"x": math.inf, "y": -math.inf, "z": math.nan}, seed=0)
    store.record_round(run_id, round=0, model_version=0, metrics={"loss": math.nan})
    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            config = conn.execute(text("SELECT config FROM runs")).scalar_one()
            metrics = conn.execute(text("SELECT metrics FROM rounds")).scalar_one()
    finally:
        engine.dispose()

    def strict(value):
        if isinstance(value, str):
            return json.loads(value, parse_constant=lambda c: pytest.fail(f"JSON has {c}"))
        return value

    assert strict(config) == {"x": "Infinity", "y": "-Infinity", "z": "NaN"}
    assert strict(metrics) == {"loss": "NaN"}
    got = store.get_run(run_id).config
    assert got["x"] == math.inf and got["y"] == -math.inf and math.isnan(got["z"])
    assert math.isnan(store.rounds(run_id)[0].metrics["loss"])


# ---- rounds and updates


def test_record_round_with_updates(store: Store):
    run_id = store.create_run(config=CONFIG, seed=7)
    for rnd in (1, 2):
        store.record_round(
            run_id,
            round=rnd,
            model_version=rnd,
            num_sampled=5,
            num_replies=4,
            num_accepted=2,
            num_rejected=1,
            num_dropped=1,
            metrics={"accuracy": np.float64(0.5 + rnd / 10), "loss": np.float32(1.5), "n": 3},
            wall_s=0.25 * rnd,
            updates=updates_for_round(rnd),
        )
    rounds = store.rounds(run_id)
    assert [r.round for r in rounds] == [1, 2]
    r2 = rounds[1]
    assert isinstance(r2, RoundInfo)
    assert (r2.model_version, r2.status) == (2, "completed")
    assert (r2.num_sampled, r2.num_replies, r2.num_accepted) == (5, 4, 2)
    assert (r2.num_rejected, r2.num_dropped) == (1, 1)
    assert r2.metrics == {"accuracy": 0.7, "loss": 1.5, "n": 3.0}
    assert all(type(v) is float for v in r2.metrics.values())
    assert r2.wall_s == 0.5
    assert r2.started_at is not None and r2.started_at.tzinfo is not None
    assert store.get_run(run_id).num_rounds == 2

    all_updates = store.updates(run_id)
    assert [rnd for rnd, _ in all_updates] == [1, 1, 1, 1, 2, 2, 2, 2]
    only2 = store.updates(run_id, round=2)
    assert [u.client_id for _, u in only2] == ["c0", "c1", "c2", "c3"]
    c0, c1, c2, c3 = (u for _, u in only2)
    assert c0 == UpdateRecord(
        "c0",
        "accepted",
        num_examples=120,
        base_version=1,
        staleness=0,
        norm=1.25,
        weight=0.5,
        metrics={"train_loss": 0.7, "num_batches": 4.0},
    )
    assert (c1.num_examples, c1.staleness, c1.norm, c1.metrics) == (
        80,
        0,
        0.5,
        {"train_loss": 0.25},
    )
    assert type(c1.num_examples) is int and type(c1.norm) is float
    assert (c2.fate, c2.reason, c2.norm) == ("rejected", "non-finite values", None)  # NaN -> NULL
    assert (c3.fate, c3.reason, c3.metrics) == ("dropped", "deadline passed", {})
    assert store.updates(run_id, round=9) == []


def test_plain_updates_read_back_as_written(store: Store):
    """Updates made of plain str/int/float values (as the server records them) read back
    equal to what was written, and equal to the same values given as numpy scalars."""
    run_id = store.create_run(config={}, seed=0)
    plain = [UpdateRecord(str(i), "accepted", num_examples=i + 1, base_version=2 ** 31 - 1,
                          staleness=-(2 ** 31), norm=0.1 * i, weight=float(i + 1),
                          metrics={"train_loss": 1.0 / (i + 1), "num-examples": i + 1.0})
             for i in range(5)]
    plain += [UpdateRecord("r", "rejected", reason="late"), UpdateRecord("d", "dropped")]
    numpy_typed = [UpdateRecord(u.client_id, u.fate, reason=u.reason,
                                num_examples=None if u.num_examples is None
                                else np.int64(u.num_examples),
                                base_version=u.base_version, staleness=u.staleness,
                                norm=None if u.norm is None else np.float64(u.norm),
                                weight=u.weight,
                                metrics={k: np.float64(v) for k, v in u.metrics.items()})
                   for u in plain]
    store.record_round(run_id, round=1, model_version=1, updates=plain)
    store.record_round(run_id, round=2, model_version=2, updates=numpy_typed)
    got1 = [u for _, u in store.updates(run_id, round=1)]
    got2 = [u for _, u in store.updates(run_id, round=2)]
    assert got1 == plain
    assert got2 == plain


@pytest.mark.parametrize(("field", "value", "match"), [
    ("num_examples", 2 ** 63, "does not fit in 64 bits"),
    ("base_version", -(2 ** 31) - 1, "does not fit in 32 bits"),
    ("staleness", 2 ** 31, "does not fit in 32 bits"),
    ("num_examples", True, "got a bool"),
    ("reason", 3, "reason must be a str"),
])
def test_plain_update_values_out_of_range_are_refused(store: Store, field, value, match):
    run_id = store.create_run(config={}, seed=0)
    update = UpdateRecord("c", "accepted", num_examples=3)
    object.__setattr__(update, field, value)
    with pytest.raises((TypeError, ValueError), match=match):
        store.record_round(run_id, round=1, model_version=1, updates=[update])
    assert store.updates(run_id) == []


def test_infinite_norm_is_kept(store: Store):
    run_id = store.create_run(config={}, seed=0)
    store.record_round(
        run_id,
        round=1,
        model_version=1,
        updates=[UpdateRecord("c", "rejected", reason="norm too large", norm=math.inf)],
    )
    ((_, rec),) = store.updates(run_id)
    assert rec.norm == math.inf


def test_record_round_again_replaces_it(store: Store):
    run_id = store.create_run(config={}, seed=0)
    store.record_round(run_id, round=3, model_version=3, updates=updates_for_round(3))
    store.record_round(
        run_id,
        round=3,
        model_version=4,
        status="aborted",
        updates=[UpdateRecord("c9", "dropped", reason="server restarted")],
    )
    (only,) = store.rounds(run_id)
    assert (only.model_version, only.status) == (4, "aborted")
    assert [u.client_id for _, u in store.updates(run_id)] == ["c9"]


def test_update_fate_is_validated(store: Store):
    with pytest.raises(ValueError, match=r"fate 'lost'.*accepted, rejected, dropped"):
        UpdateRecord("c0", "lost")
    run_id = store.create_run(config={}, seed=0)
    sneaky = UpdateRecord("c0", "accepted")
    object.__setattr__(sneaky, "fate", "lost")
    with pytest.raises(ValueError, match="must be one of accepted, rejected, dropped"):
        store.record_round(run_id, round=1, model_version=1, updates=[sneaky])
    assert store.rounds(run_id) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"status": "done"}, ValueError, "must be one of completed, aborted, failed"),
        ({"num_sampled": -1}, ValueError, "num_sampled must be >= 0"),
        ({"round": -1}, ValueError, "round must be >= 0"),
        ({"num_replies": 2.0}, TypeError, "num_replies must be an integer"),
        ({"wall_s": math.nan}, ValueError, "wall_s"),
        ({"metrics": {"acc": "high"}}, ValueError, "metrics must be numbers"),
        ({"metrics": {"acc": None}}, ValueError, "metrics must be numbers"),
        ({"updates": [UpdateRecord("c", "accepted", metrics={"x": [1.0]})]}, ValueError, "numbers"),
        ({"updates": [UpdateRecord("c", "accepted", num_examples=-3)]}, ValueError, ">= 0"),
        ({"updates": [("c", "accepted")]}, TypeError, "not an UpdateRecord"),
        ({"updates": UpdateRecord("c", "accepted")}, TypeError, "sequence of UpdateRecord"),
    ],
)
def test_record_round_validation_writes_nothing(store: Store, kwargs, error, match):
    run_id = store.create_run(config={}, seed=0)
    args = {"round": 1, "model_version": 1, "updates": updates_for_round(1)} | kwargs
    with pytest.raises(error, match=match):
        store.record_round(run_id, **args)
    assert store.rounds(run_id) == []
    assert store.updates(run_id) == []


# ---- unknown runs


def test_unknown_run_error_names_the_run_and_database(store: Store):
    store.create_run(config={}, seed=0)
    expected = f"no run 'rnope' in {store.display_url()}"
    calls = [
        lambda: store.get_run("rnope"),
        lambda: store.finish_run("rnope", status="stopped"),
        lambda: store.record_round("rnope", round=1, model_version=1),
        lambda: store.rounds("rnope"),
        lambda: store.updates("rnope"),
        lambda: store.save_checkpoint(
            "rnope", round=1, model_version=1, params=np.zeros(2, np.float32), state={}
        ),
        lambda: store.load_checkpoint("rnope"),
    ]
    for call in calls:
        with pytest.raises(UnknownRun) as info:
            call()
        assert str(info.value) == expected
        assert isinstance(info.value, LookupError)


def test_display_url_masks_the_password():
    url = "postgresql+psycopg://fedring:s3cret@db.example:5432/runs"
    assert mask_url(url) == "postgresql+psycopg://fedring:***@db.example:5432/runs"
    assert "s3cret" not in mask_url("postgresql://u:s3cret@h/db")
    assert mask_url("sqlite:///runs/fedring.db") == "sqlite:///runs/fedring.db"


def test_store_url_and_display_url(store: Store, store_url: str):
    assert store.url == store_url
    assert store.display_url() == mask_url(store_url)
    assert repr(store) == f"Store({store.display_url()!r})"


def test_bad_url_is_a_value_error():
    with pytest.raises(ValueError, match="not a database URL"):
        Store("runs/fedring.db")


def test_closed_store_refuses_calls(open_store):
    store = open_store()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.list_runs()


# ---- checkpoints


def _state(rnd: int) -> dict:
    return {
        "round": rnd,
        "server_opt": {"name": "adam", "m": np.full(4, rnd, np.float64), "t": np.int64(rnd)},
        "layer1.weight": np.ones((2, 2), np.float32) * rnd,
        "clip": {"norm": 0.1 * rnd, "adaptive": True, "quantile": None},
    }


def test_checkpoint_round_trip(store: Store):
    run_id = store.create_run(config={}, seed=0)
    assert store.load_checkpoint(run_id) is None
    params = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    sha = store.save_checkpoint(run_id, round=4, model_version=4, params=params, state=_state(4))
    assert re.fullmatch(r"[0-9a-f]{64}", sha)
    ckpt = store.load_checkpoint(run_id)
    assert isinstance(ckpt, Checkpoint)
    assert (ckpt.round, ckpt.model_version, ckpt.sha256) == (4, 4, sha)
    assert ckpt.params.dtype == np.float32 and ckpt.params.tobytes() == params.tobytes()
    assert ckpt.state["server_opt"]["m"].tolist() == [4.0] * 4
    assert ckpt.state["server_opt"]["t"] == np.int64(4)
    assert type(ckpt.state["server_opt"]["t"]) is np.int64
    assert ckpt.state["clip"] == {"norm": 0.4, "adaptive": True, "quantile": None}
    assert ckpt.state["layer1.weight"].dtype == np.float32


def test_checkpoint_sha256_is_over_the_stored_payload(store: Store, store_url: str):
    run_id = store.create_run(config={}, seed=0)
    sha = store.save_checkpoint(
        run_id, round=1, model_version=1, params=np.ones(8, np.float32), state=_state(1)
    )
    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            payload = conn.execute(text("SELECT payload FROM checkpoints")).scalar_one()
    finally:
        engine.dispose()
    assert hashlib.sha256(bytes(payload)).hexdigest() == sha


def test_checkpoint_keep_prunes_oldest(store: Store):
    run_id = store.create_run(config={}, seed=0)
    other = store.create_run(config={}, seed=1)
    store.save_checkpoint(other, round=1, model_version=1, params=np.zeros(2, np.float32), state={})
    for rnd in range(1, 6):
        store.save_checkpoint(
            run_id,
            round=rnd,
            model_version=rnd,
            params=np.full(3, rnd, np.float32),
            state=_state(rnd),
        )
    assert store.load_checkpoint(run_id).round == 5
    assert store.load_checkpoint(run_id, round=4).round == 4
    for gone in (1, 2, 3):
        assert store.load_checkpoint(run_id, round=gone) is None
    # keep applies per run: the other run's checkpoint is untouched
    assert store.load_checkpoint(other).round == 1
    store.save_checkpoint(
        run_id, round=6, model_version=6, params=np.zeros(3, np.float32), state={}, keep=3
    )
    kept = [r for r in range(1, 7) if store.load_checkpoint(run_id, round=r) is not None]
    assert kept == [4, 5, 6]
    store.save_checkpoint(
        run_id, round=7, model_version=7, params=np.zeros(3, np.float32), state={}, keep=1
    )
    kept = [r for r in range(1, 8) if store.load_checkpoint(run_id, round=r) is not None]
    assert kept == [7]


def test_checkpoint_for_same_round_is_replaced(store: Store):
    run_id = store.create_run(config={}, seed=0)
    store.save_checkpoint(
        run_id, round=2, model_version=2, params=np.zeros(3, np.float32), state={}
    )
    sha = store.save_checkpoint(
        run_id, round=2, model_version=3, params=np.ones(3, np.float32), state={"v": 2}
    )
    ckpt = store.load_checkpoint(run_id, round=2)
    assert (ckpt.model_version, ckpt.sha256, ckpt.state) == (3, sha, {"v": 2})
    assert ckpt.params.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("params", "kwargs"),
    [
        (np.zeros(3, np.float64), {}),
        (np.zeros((2, 2), np.float32), {}),
        ([0.0, 1.0], {}),
        (np.zeros(3, np.float32), {"keep": 0}),
    ],
    ids=["float64", "2-d", "list", "keep-0"],
)
def test_checkpoint_validation(store: Store, params, kwargs):
    run_id = store.create_run(config={}, seed=0)
    with pytest.raises(ValueError):
        store.save_checkpoint(run_id, round=1, model_version=1, params=params, state={}, **kwargs)
    assert store.load_checkpoint(run_id) is None


def _tamper(store_url: str, **values) -> None:
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(CheckpointRow.__table__).values(**values))
    finally:
        engine.dispose()


def test_corrupted_payload_is_detected(store: Store, store_url: str):
    run_id = store.create_run(config={}, seed=0)
    params = np.arange(100, dtype=np.float32)
    sha = store.save_checkpoint(run_id, round=3, model_version=3, params=params, state=_state(3))
    good = store.load_checkpoint(run_id)
    engine = create_engine(store_url)
    with engine.connect() as conn:
        payload = bytearray(conn.execute(text("SELECT payload FROM checkpoints")).scalar_one())
    engine.dispose()
    payload[len(payload) // 2] ^= 0x01  # one flipped bit somewhere in the arrays
    _tamper(store_url, payload=bytes(payload))
    with pytest.raises(CorruptCheckpoint) as info:
        store.load_checkpoint(run_id)
    message = str(info.value)
    assert f"run {run_id!r} at round 3" in message and "corrupted" in message
    assert sha in message and store.display_url() in message
    with pytest.raises(CorruptCheckpoint):
        store.load_checkpoint(run_id, round=3)
    assert good.params.tobytes() == params.tobytes()


def test_undecodable_payload_with_matching_hash_is_reported(store: Store, store_url: str):
    run_id = store.create_run(config={}, seed=0)
    store.save_checkpoint(
        run_id, round=1, model_version=1, params=np.zeros(2, np.float32), state={}
    )
    junk = b"definitely not an npz archive"
    _tamper(store_url, payload=junk, sha256=hashlib.sha256(junk).hexdigest())
    with pytest.raises(CorruptCheckpoint, match="cannot be decoded"):
        store.load_checkpoint(run_id)


# ---- SQLite specifics


def test_sqlite_file_wal_and_foreign_keys(store: Store, store_url: str, is_sqlite: bool):
    if not is_sqlite:
        pytest.skip("SQLite only")
    path = Path(store_url.removeprefix("sqlite:///"))
    assert path.is_file()  # its folder did not exist before
    store.create_run(config={}, seed=0)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
    with store._engine.connect() as c:  # the store's own connections
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_sqlite_in_memory_works_across_threads(url: str):
    store = Store(url)
    try:
        run_id = store.create_run(config={"a": 1}, seed=0)
        worker = threading.Thread(
            target=store.record_round,
            args=(run_id,),
            kwargs={"round": 1, "model_version": 1, "updates": updates_for_round(1)},
        )
        worker.start()
        worker.join()
        assert len(store.updates(run_id)) == 4
    finally:
        store.close()


def test_reopening_keeps_everything(open_store):
    first = open_store()
    run_id = first.create_run(config=CONFIG, seed=3, name="persist")
    first.record_round(run_id, round=1, model_version=1, updates=updates_for_round(1))
    sha = first.save_checkpoint(
        run_id, round=1, model_version=1, params=np.ones(4, np.float32), state=_state(1)
    )
    first.close()
    second = open_store()  # create_all on an existing schema is a no-op
    assert second.get_run(run_id).config == CONFIG
    assert len(second.updates(run_id)) == 4
    assert second.load_checkpoint(run_id).sha256 == sha
