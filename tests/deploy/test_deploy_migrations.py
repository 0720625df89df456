"""Alembic: ``upgrade head`` on an empty database gives exactly ``metadata.create_all``'s schema.

On SQLite always, and on PostgreSQL when ``FEDRING_TEST_POSTGRES_URL`` is set (each case in
its own schema, dropped afterwards).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from server.store import Store
from server.store.migrations import alembic_config, current, engine_for, upgrade
from server.store.models import Base

POSTGRES_ENV = "FEDRING_TEST_POSTGRES_URL"
BACKENDS = ["sqlite"] + (["postgres"] if os.environ.get(POSTGRES_ENV) else [])


@pytest.fixture(params=BACKENDS)
def new_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of URLs of fresh, empty databases on one back end."""
    if request.param == "sqlite":
        yield lambda name: f"sqlite:///{tmp_path / f'{name}.db'}"
        return
    base = make_url(os.environ[POSTGRES_ENV]).set(drivername="postgresql+psycopg")
    admin, schemas = create_engine(base), []

    def make(name: str) -> str:
        schema = f"fedring_mig_{name}_{uuid.uuid4().hex[:10]}"
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        schemas.append(schema)
        url = base.update_query_dict({"options": f"-csearch_path={schema}"})
        return url.render_as_string(hide_password=False)

    try:
        yield make
    finally:
        with admin.begin() as conn:
            for schema in schemas:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def head() -> str | None:
    """The newest revision."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def schema_of(url: str) -> dict[str, Any]:
    """Tables, columns (type, nullability), keys, foreign keys (with ON DELETE) and indexes."""
    engine = engine_for(url)
    try:
        insp = inspect(engine)
        out = {}
        for table in sorted(set(insp.get_table_names()) - {"alembic_version"}):
            pk = insp.get_pk_constraint(table)
            out[table] = {
                "columns": [(c["name"], str(c["type"]), c["nullable"])
                            for c in insp.get_columns(table)],
                "pk": (pk["name"], pk["constrained_columns"]),
                "fks": sorted((fk["name"], fk["constrained_columns"], fk["referred_table"],
                               fk["referred_columns"], fk["options"].get("ondelete"))
                              for fk in insp.get_foreign_keys(table)),
                "indexes": sorted((i["name"], i["column_names"], bool(i["unique"]))
                                  for i in insp.get_indexes(table)),
                "uniques": sorted((u["name"], u["column_names"])
                                  for u in insp.get_unique_constraints(table)),
            }
        return out
    finally:
        engine.dispose()


def test_upgrade_head_is_create_all(new_url: Any) -> None:
    created, migrated = new_url("created"), new_url("migrated")
    engine = engine_for(created)
    Base.metadata.create_all(engine)
    engine.dispose()
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert upgrade(migrated) == head and current(migrated) == head
    expected, got = schema_of(created), schema_of(migrated)
    assert set(expected) == set(Base.metadata.tables)
    assert got == expected
    engine = engine_for(migrated)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    engine.dispose()


def test_store_works_on_a_migrated_database(new_url: Any) -> None:
    url = new_url("store")
    upgrade(url)
    with Store(url) as store:
        run_id = store.create_run(config={"name": "m"}, seed=3, name="m")
        store.record_round(run_id, round=1, model_version=1, status="completed",
                           num_sampled=1, num_replies=1, num_accepted=1, num_rejected=0,
                           num_dropped=0, metrics={"accuracy": 0.5}, wall_s=0.1, updates=[])
        assert [r.round for r in store.rounds(run_id)] == [1]


def test_a_store_made_by_create_all_is_stamped_then_kept(new_url: Any) -> None:
    url = new_url("stamped")
    Store(url).close()  # Store creates the schema itself
    assert current(url) is None
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert upgrade(url) == head
    assert upgrade(url) == head  # idempotent


def test_a_foreign_schema_is_not_stamped(new_url: Any) -> None:
    url = new_url("foreign")
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE runs (run_id VARCHAR(32) PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(RuntimeError, match="differ from the models"):
        upgrade(url)
    assert current(url) is None


def test_a_ledger_written_before_0002_keeps_its_rows(new_url: Any) -> None:
    url = new_url("ledger")
    assert upgrade(url, "0001") == "0001"
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, created_at, status, seed, config) VALUES "
                          "('r1', '2026-11-22 10:00:00+00:00', 'completed', 0, '{}')"))
        conn.execute(text("INSERT INTO privacy_ledger (run_id, round, mode, accountant, "
                          "epsilon, delta, noise_multiplier, clip, sampling_rate) VALUES "
                          "('r1', 1, 'central', 'rdp', 2.5, 1e-5, 1.1, 1.0, 0.25)"))
    engine.dispose()
    assert upgrade(url) == head()
    with Store(url) as store:
        [row] = store.privacy_ledger("r1")
        assert row["epsilon"] == 2.5 and row["sampling_rate"] == 0.25
        assert row["epsilon_model"] is None and row["protects_against"] is None
        assert row["relation"] is None and row["epsilon_replace_one"] is None
        store.record_privacy("r1", round=2, mode="distributed", accountant="rdp", epsilon=12.3,
                             delta=1e-5, noise_multiplier=1.0, clip=1.0, sampling_rate=0.5,
                             epsilon_model=26.8, protects_against="server")
        new = store.privacy_ledger("r1")[1]
        assert (new["epsilon_model"], new["protects_against"]) == (26.8, "server")
        with pytest.raises(ValueError, match="epsilon_model"):
            store.record_privacy("r1", round=3, mode="distributed", accountant="rdp",
                                 epsilon=1.0, delta=1e-5, noise_multiplier=1.0, clip=1.0,
                                 sampling_rate=0.5, epsilon_model=float("nan"))


def test_a_ledger_written_at_0002_gains_the_relations(new_url: Any) -> None:
    url = new_url("relations")
    assert upgrade(url, "0002") == "0002"
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, created_at, status, seed, config) VALUES "
                          "('r1', '2026-11-27 10:00:00+00:00', 'completed', 0, '{}')"))
        conn.execute(text("INSERT INTO privacy_ledger (run_id, round, mode, accountant, "
                          "epsilon, delta, noise_multiplier, clip, sampling_rate, "
                          "epsilon_model, protects_against) VALUES ('r1', 1, 'local', "
                          "'rdp', 4.7, 1e-5, 1.0, 1.0, 0.25, 9.1, 'server')"))
    engine.dispose()
    assert upgrade(url) == head()
    with Store(url) as store:
        [row] = store.privacy_ledger("r1")
        assert (row["epsilon"], row["epsilon_model"]) == (4.7, 9.1)
        assert (row["relation"], row["relation_model"]) == (None, None)
        store.record_privacy("r1", round=2, mode="local", accountant="rdp", epsilon=7.1,
                             delta=1e-5, noise_multiplier=1.0, clip=1.0, sampling_rate=0.25,
                             protects_against="server", relation="zero-out",
                             epsilon_replace_one=16.5)
        new = store.privacy_ledger("r1")[1]
        assert (new["relation"], new["epsilon_replace_one"]) == ("zero-out", 16.5)


def test_a_store_at_0003_gains_the_evaluations_and_keeps_its_rounds(new_url: Any) -> None:
    """0003 -> 0004: the evaluations table appears, empty; the rounds and updates stay; a
    round recorded again with its evaluations reads them back, and re-recording it (as a
    resume does) replaces them."""
    from server.store import EvalRecord, UpdateRecord

    url = new_url("evaluations")
    assert upgrade(url, "0003") == "0003"
    engine = engine_for(url)
    assert "evaluations" not in inspect(engine).get_table_names()
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, created_at, status, seed, config) VALUES "
                          "('r1', '2026-11-28 10:00:00+00:00', 'completed', 0, '{}')"))
        conn.execute(text("INSERT INTO rounds (run_id, round, model_version, status, "
                          "num_sampled, num_replies, num_accepted, num_rejected, num_dropped, "
                          "metrics, wall_s) VALUES ('r1', 1, 1, 'completed', 2, 2, 2, 0, 0, "
                          "'{\"accuracy\": 0.5}', 0.1)"))
        conn.execute(text("INSERT INTO updates (run_id, round, client_id, fate, metrics) "
                          "VALUES ('r1', 1, 'c1', 'accepted', '{}')"))
    engine.dispose()
    assert upgrade(url, "0004") == "0004" and upgrade(url) == head()
    assert schema_of(url)["evaluations"]["indexes"] == [
        ("ix_evaluations_run_id_round", ["run_id", "round"], False)]
    with Store(url) as store:
        assert [r.metrics for r in store.rounds("r1")] == [{"accuracy": 0.5}]
        assert [u.client_id for _, u in store.updates("r1")] == ["c1"]
        assert store.evaluations("r1") == []
        answers = [EvalRecord("c1", "accepted", num_examples=7, loss=0.3, accuracy=0.75,
                              loss_personal=0.2, accuracy_personal=0.875),
                   EvalRecord("c2", "rejected", reason="evaluate reply's 'eval_acc' must be "
                              "in [0, 1], got 1.5"),
                   EvalRecord("c3", "dropped", reason="late: no reply within 5 s")]
        store.record_round("r1", round=2, model_version=2, metrics={"accuracy": 0.6},
                           updates=[UpdateRecord("c1", "accepted")], evaluations=answers)
        assert store.evaluations("r1") == [(2, a) for a in answers]
        assert store.evaluations("r1", round=1) == []
        store.record_round("r1", round=2, model_version=2, evaluations=answers[:1])
        assert store.evaluations("r1") == [(2, answers[0])]
