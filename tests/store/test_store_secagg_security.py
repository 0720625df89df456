"""``secagg_rounds.security``: which threat model each secure session held against, written
from the session's record, and migrated (0004 -> 0005) with old rows reading semi-honest."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from server.secure_outcome import SecureRoundOutcome, with_refusals
from server.store import Store, StoreUnavailable
from server.store.migrations import current, engine_for, upgrade


def _outcome(security: str) -> SecureRoundOutcome:
    return SecureRoundOutcome(status="completed", participants=[1, 2, 3], k=2, t=2,
                              survivors=[1, 2, 3], dropouts={"consistency_check": []},
                              security=security)


def test_each_session_record_keeps_its_mode(store: Store) -> None:
    run_id = store.create_run(config={}, seed=0)
    _outcome("malicious").save(store, run_id, 1)
    _outcome("semi_honest").save(store, run_id, 2)
    assert [(r["round"], r["security"]) for r in store.secagg_rounds(run_id)] == [
        (1, "malicious"), (2, "semi_honest")]
    with pytest.raises(ValueError, match="secure round 3: security 'paranoid'"):
        store.record_secagg_round(run_id, round=3, status="completed", k=2, t=2,
                                  participants=[1], dropouts={}, survivors=[1], rejected={},
                                  security="paranoid")


def test_a_store_at_0004_gains_the_mode_and_its_rows_read_semi_honest(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    assert upgrade(url, "0004") == "0004"
    engine = engine_for(url)
    assert "security" not in {c["name"] for c in inspect(engine).get_columns("secagg_rounds")}
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, created_at, status, seed, config) VALUES "
                          "('r1', '2026-11-28 10:00:00+00:00', 'completed', 0, '{}')"))
        conn.execute(text("INSERT INTO secagg_rounds (run_id, round, status, k, t, "
                          "num_participants, num_survivors, participants, dropouts, "
                          "survivors, rejected, excluded, seconds) VALUES ('r1', 1, "
                          "'completed', 2, 2, 3, 3, '[\"1\", \"2\", \"3\"]', '{}', "
                          "'[\"1\", \"2\", \"3\"]', '{}', '{}', '{}')"))
    engine.dispose()
    assert upgrade(url) == current(url) == "0005"
    with Store(url) as store:
        [old] = store.secagg_rounds("r1")
        assert old["security"] == "semi_honest" and old["survivors"] == ["1", "2", "3"]
        _outcome("malicious").save(store, "r1", 2)
        assert [r["security"] for r in store.secagg_rounds("r1")] == ["semi_honest",
                                                                      "malicious"]


def test_an_abort_names_the_clients_refusal() -> None:
    errors = {1: "train.secagg message refused: no identity key",
              2: "train.secagg message refused: no identity key",
              3: "no reply before the deadline"}
    assert with_refusals("too few left", errors) == (
        "too few left; 2 clients answered: train.secagg message refused: no identity key")
    assert with_refusals("too few left", {3: "simulated dropout"}) == "too few left"
    assert with_refusals(None, errors) is None


def test_a_store_made_by_an_older_fedring_is_refused_at_open_with_the_upgrade_command(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    assert upgrade(url, "0004") == "0004"
    with pytest.raises(StoreUnavailable, match=r"table secagg_rounds has no column security\); "
                                               r"upgrade it with: python -m "
                                               r"server\.store\.migrations upgrade"):
        Store(url)
    assert upgrade(url) == "0005"
    with Store(url) as store:  # upgraded: opens, and the mode is written
        run = store.create_run(config={}, seed=0)
        _outcome("malicious").save(store, run, 1)
        assert [r["security"] for r in store.secagg_rounds(run)] == ["malicious"]
