"""Alembic migrations of the run store (``versions/``), and how to apply them.

``Store(url)`` still creates a missing schema with ``metadata.create_all``; revision
``0001`` is exactly that schema. To keep a database current across fedring versions::

    python -m server.store.migrations upgrade --db postgresql+psycopg://...   # or sqlite:///...
    python -m server.store.migrations current --db ...

A store that ``Store(url)`` created has fedring's tables but no ``alembic_version``:
:func:`upgrade` stamps it at the head revision when its schema is exactly the models'
(what ``create_all`` of this version makes), and refuses otherwise (stamp such a store by
hand at the revision it matches). The plain alembic command works too:
``alembic -c server/store/migrations/alembic.ini -x url=... upgrade head``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

HERE = Path(__file__).resolve().parent


def engine_for(url: str) -> Engine:
    """An engine configured as the store configures its own (SQLite pragmas, psycopg)."""
    from server.store.engine import make_engine, parse_url

    return make_engine(parse_url(url))


def alembic_config(url: str | None = None) -> Config:
    """An alembic ``Config`` for these migrations (no ``alembic.ini`` needed)."""
    cfg = Config(str(HERE / "alembic.ini"))
    cfg.set_main_option("script_location", str(HERE))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def current(url: str) -> str | None:
    """The database's alembic revision (None: never migrated)."""
    engine = engine_for(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> str | None:
    """Migrate the store at ``url`` to ``revision``; returns the revision it is at."""
    from server.store.models import Base

    engine = engine_for(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            tables = set(inspect(conn).get_table_names())
            unversioned = MigrationContext.configure(conn).get_current_revision() is None
            if unversioned and tables & set(Base.metadata.tables):
                _check_matches_models(conn, tables)
                command.stamp(cfg, "head")
            command.upgrade(cfg, revision)
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _check_matches_models(conn: object, tables: set[str]) -> None:
    """Refuse to stamp a database whose fedring tables are not exactly the models'."""
    from alembic.autogenerate import compare_metadata

    from server.store.models import Base

    missing = set(Base.metadata.tables) - tables
    diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    if missing or diffs:
        raise RuntimeError(f"the store has fedring tables but no alembic revision, and they "
                           f"differ from the models: missing {sorted(missing)}, differences "
                           f"{diffs}; stamp it at the revision it matches (alembic stamp)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.store.migrations",
                                     description="migrate fedring's run store")
    parser.add_argument("action", choices=("upgrade", "current"))
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the run store")
    parser.add_argument("--revision", default="head", help="target revision (upgrade)")
    args = parser.parse_args(argv)
    if args.action == "upgrade":
        print(upgrade(args.db, args.revision))
    else:
        print(current(args.db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
