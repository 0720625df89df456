"""The checkpoint payload's formats: format 2 (raw parameters, then the state archive) is
written; format 1 (one ``pack_state`` archive, as written before) still resumes a run to
the same model; a payload of neither is refused with a message that says why."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from sqlalchemy import create_engine, text, update

from server.reporter import LogReporter
from server.store import CorruptCheckpoint, Store, pack_state
from server.store.checkpoints import MAGIC, open_payload, seal
from server.store.models import CheckpointRow
from simulations.cli import run_simulation
from simulations.config import load_scenario

FAST = ["federation.clients=3", "train.local_epochs=1", "data.partitioner=iid",
        "federation.rounds=3", "aggregation.server_opt=fedadam"]  # a server state to keep


def _payload(url: str) -> tuple[bytes, str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT payload, sha256 FROM checkpoints "
                                    "ORDER BY round DESC LIMIT 1")).one()
    finally:
        engine.dispose()
    return bytes(row[0]), row[1]


def _rewrite(url: str, payload: bytes) -> None:
    """Replace the newest checkpoint's payload (and its sha256), as another writer would."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            newest = conn.execute(text("SELECT max(round) FROM checkpoints")).scalar_one()
            conn.execute(update(CheckpointRow.__table__)
                         .where(CheckpointRow.__table__.c.round == newest)
                         .values(payload=payload,
                                 sha256=hashlib.sha256(payload).hexdigest()))
    finally:
        engine.dispose()


def test_seal_writes_format_2_and_reads_back_exactly():
    params = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    state = {"m": np.arange(3.0), "step": 7, "nested": {"x": [1, (2.5, None)]}}
    payload, digest = seal(params, state)
    assert payload.startswith(MAGIC) and digest == hashlib.sha256(payload).hexdigest()
    assert payload[24:24 + params.nbytes] == params.astype("<f4").tobytes()  # raw, once
    got, got_state = open_payload(payload)
    assert got.dtype == np.float32 and got.tobytes() == params.tobytes()
    got[0] = 1.0  # the caller's own copy
    np.testing.assert_array_equal(got_state["m"], state["m"])
    assert got_state["step"] == 7 and got_state["nested"] == {"x": [1, (2.5, None)]}


def test_format_1_payload_still_loads(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    params, state = np.arange(50, dtype=np.float32), {"opt": {"v": np.ones(4)}, "t": 3}
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0)
        store.save_checkpoint(run_id, round=1, model_version=1, params=params, state={})
    _rewrite(url, pack_state(params, state))  # format 1: one npz archive
    with Store(url) as store:
        ckpt = store.load_checkpoint(run_id)
    assert ckpt.params.tobytes() == params.tobytes()
    np.testing.assert_array_equal(ckpt.state["opt"]["v"], np.ones(4))
    assert ckpt.state["t"] == 3


@pytest.mark.parametrize("damage, match", [
    (lambda p: p[:6] + b"\x00\x03" + p[8:], "format 0003 is not one this code reads"),
    (lambda p: p[:20], "shorter than its header"),
    (lambda p: p[:-1], "does not hold the 50 parameters"),
])
def test_a_damaged_format_2_payload_is_refused_with_its_reason(tmp_path, damage, match):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0)
        store.save_checkpoint(run_id, round=1, model_version=1,
                              params=np.arange(50, dtype=np.float32), state={"a": 1})
    payload, _ = _payload(url)
    _rewrite(url, damage(payload))  # with a matching sha256: decoding must catch it
    with Store(url) as store, pytest.raises(CorruptCheckpoint, match="cannot be decoded") \
            as info:
        store.load_checkpoint(run_id)
    assert match in str(info.value)


class _Interrupt(LogReporter):
    """Stops the server process after round 2, as a crash would."""

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        super().round_finished(rnd, metrics)
        if rnd == 2:
            raise KeyboardInterrupt


@pytest.mark.parametrize("old_format", [False, True])
def test_a_run_resumed_from_either_format_ends_on_the_same_model(tmp_path, old_format):
    config = load_scenario("default", FAST)
    whole = f"sqlite:///{tmp_path / 'whole.db'}"
    run_simulation(config, engine="inprocess", db=whole)
    resumed = f"sqlite:///{tmp_path / 'resumed.db'}"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(config, engine="inprocess", db=resumed, reporter=_Interrupt())
    payload, _ = _payload(resumed)
    assert payload.startswith(MAGIC)
    if old_format:  # the checkpoint of round 2 as fedring wrote it before format 2
        params, state = open_payload(payload)
        assert state["pipeline"]  # FedAdam's moments: the state must survive too
        _rewrite(resumed, pack_state(params, state))
    with Store(resumed) as store:
        (run,) = store.list_runs()
    summary = run_simulation(config, engine="inprocess", db=resumed, resume=run.run_id)
    assert summary["resumed_after_round"] == 2 and summary["rounds"] == 3
    want, got = open_payload(_payload(whole)[0]), open_payload(_payload(resumed)[0])
    assert got[0].tobytes() == want[0].tobytes()
