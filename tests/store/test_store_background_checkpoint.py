"""Checkpoints written on the store's writer thread: snapshot, order, errors, page size."""

from __future__ import annotations

import sqlite3
import threading

import numpy as np
import pytest

from server.store import Store, UnknownRun, UpdateRecord, repository
from server.store.checkpoints import seal


def _sqlite_path(url: str) -> str:
    return url.removeprefix("sqlite:///")


@pytest.fixture
def background_always(monkeypatch):
    """Every checkpoint goes to the writer thread, however small."""
    monkeypatch.setattr(repository, "BACKGROUND_MIN_BYTES", 0)


def test_background_save_snapshots_params_and_state(open_store, monkeypatch, background_always):
    store = open_store()
    run_id = store.create_run(config={}, seed=0)
    params = np.arange(1000, dtype=np.float32)
    state = {"opt": {"m": np.ones(3, np.float32)}, "step": 4}
    changed = threading.Event()  # the writer encodes only after the caller's changes

    def seal_later(*args):
        assert changed.wait(30)
        return seal(*args)

    monkeypatch.setattr(repository, "seal", seal_later)
    store.save_checkpoint_in_background(run_id, round=1, model_version=1, params=params,
                                        state=state)
    params += 100.0  # the caller goes on changing its model and state at once
    state["opt"]["m"][:] = 7.0
    state["step"] = 5
    changed.set()
    store.flush()
    ckpt = open_store().load_checkpoint(run_id)
    assert ckpt.round == 1 and ckpt.model_version == 1
    np.testing.assert_array_equal(ckpt.params, np.arange(1000, dtype=np.float32))
    np.testing.assert_array_equal(ckpt.state["opt"]["m"], np.ones(3, np.float32))
    assert ckpt.state["step"] == 4


def test_background_save_keeps_the_newest_two(open_store, background_always):
    store = open_store()
    run_id = store.create_run(config={}, seed=0)
    for rnd in range(1, 5):
        store.save_checkpoint_in_background(run_id, round=rnd, model_version=rnd,
                                            params=np.full(10, rnd, np.float32), state={})
    store.flush()
    assert store.load_checkpoint(run_id).round == 4
    assert store.load_checkpoint(run_id, round=3).params[0] == 3.0
    assert store.load_checkpoint(run_id, round=2) is None


def test_write_happens_off_the_callers_thread_and_before_the_next_round(tmp_path):
    url = f"sqlite:///{tmp_path / 'bg.db'}"
    with Store(url) as store, Store(url) as reader:
        run_id = store.create_run(config={}, seed=0)
        blocker = sqlite3.connect(_sqlite_path(url), timeout=30)
        blocker.execute("BEGIN IMMEDIATE")  # holds the database's write lock
        # Returns although the write cannot happen yet: it waits on the writer thread.
        store.save_checkpoint_in_background(run_id, round=1, model_version=1,
                                            params=np.ones(4_000_000, np.float32), state={})
        assert reader.load_checkpoint(run_id) is None
        blocker.rollback()
        blocker.close()
        # A round recorded after a background save implies that checkpoint is complete
        # (a resumed run then never finds a round newer than two checkpoints ago).
        store.record_round(run_id, round=2, model_version=2,
                           updates=[UpdateRecord("c1", "accepted", num_examples=3)])
        ckpt = reader.load_checkpoint(run_id)
        assert ckpt is not None and ckpt.round == 1 and ckpt.params.size == 4_000_000


def test_a_failed_background_write_raises_at_flush_once(open_store, background_always):
    store = open_store()
    store.save_checkpoint_in_background("r-missing", round=1, model_version=1,
                                        params=np.ones(3, np.float32), state={})
    with pytest.raises(UnknownRun, match="r-missing"):
        store.flush()
    store.flush()  # reported once; the store goes on working
    run_id = store.create_run(config={}, seed=0)
    store.save_checkpoint_in_background("r-missing", round=1, model_version=1,
                                        params=np.ones(3, np.float32), state={})
    with pytest.raises(UnknownRun):
        store.finish_run(run_id, status="failed")
    assert store.get_run(run_id).status == "failed"  # the status was written anyway


def test_bad_arguments_fail_in_the_caller(open_store):
    store = open_store()
    run_id = store.create_run(config={}, seed=0)
    with pytest.raises(ValueError, match="flat float32"):
        store.save_checkpoint_in_background(run_id, round=1, model_version=1,
                                            params=np.ones(3), state={})
    with pytest.raises(ValueError, match="round"):
        store.save_checkpoint_in_background(run_id, round=-1, model_version=1,
                                            params=np.ones(3, np.float32), state={})


def test_small_checkpoints_are_written_at_once_and_large_ones_in_the_background(tmp_path):
    url = f"sqlite:///{tmp_path / 'size.db'}"
    small = np.ones(repository.BACKGROUND_MIN_BYTES // 4 - 1, np.float32)
    large = np.ones(repository.BACKGROUND_MIN_BYTES // 4, np.float32)
    with Store(url) as store, Store(url) as reader:
        run_id = store.create_run(config={}, seed=0)
        store.save_checkpoint_in_background(run_id, round=1, model_version=1, params=small,
                                            state={})
        assert store._writer.in_flight is None
        assert reader.load_checkpoint(run_id).params.size == small.size
        store.save_checkpoint_in_background(run_id, round=2, model_version=2, params=large,
                                            state={})
        assert store._writer.in_flight is not None
        store.flush()
        assert reader.load_checkpoint(run_id).params.size == large.size


def test_in_memory_store_saves_at_once():
    with Store("sqlite://") as store:
        run_id = store.create_run(config={}, seed=0)
        store.save_checkpoint_in_background(run_id, round=1, model_version=1,
                                            params=np.ones(3, np.float32), state={"a": 1})
        assert store._writer.in_flight is None
        assert store.load_checkpoint(run_id).state == {"a": 1}


def test_new_sqlite_files_get_64k_pages_and_old_ones_keep_theirs(tmp_path):
    new = tmp_path / "new.db"
    with Store(f"sqlite:///{new}"):
        pass
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("CREATE TABLE before_fedring (x INTEGER)")
    conn.commit()
    conn.close()
    with Store(f"sqlite:///{old}") as store:
        run_id = store.create_run(config={}, seed=0)
        store.save_checkpoint(run_id, round=1, model_version=1,
                              params=np.ones(5, np.float32), state={})
    sizes = {}
    for path in (new, old):
        conn = sqlite3.connect(path)
        sizes[path.name] = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.close()
    assert sizes == {"new.db": 65536, "old.db": 4096}
