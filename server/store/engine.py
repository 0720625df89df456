"""The store's database connection: URL, engine and schema.

Any SQLAlchemy URL works. A SQLite file (``sqlite:///runs/fedring.db``) is the default:
its folder is created, and every connection turns on WAL (so a reader, e.g.
``fedring show`` in another process, never blocks the running server and sees each
committed round), foreign keys, a 30 s busy timeout and ``synchronous=NORMAL`` (durable
against a crashed process, which is what resume needs). A new SQLite file gets 64 KiB
pages: a checkpoint of a million parameters is then about 70 page writes instead of 1,100
(three times faster here), and small round records got faster too. PostgreSQL works through
psycopg 3: ``postgresql+psycopg://user:pw@host:5432/db`` (a bare ``postgresql://`` is
taken to mean psycopg too). A missing schema is created with ``metadata.create_all``
(``migrations`` upgrades an existing one).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import StaticPool

from .errors import StoreUnavailable
from .models import Base

URL_FORMS = ("sqlite:///PATH (a file, e.g. sqlite:///runs/fedring.db) or "
             "postgresql+psycopg://user:password@host:5432/dbname")


def parse_url(url: str) -> URL:
    """``url`` parsed; a bare ``postgresql://`` means psycopg 3. Bad URLs fail with an example."""
    if not isinstance(url, str):
        raise TypeError(f"database URL must be a str, got {type(url).__name__}")
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(
            f"not a database URL: {url!r}; e.g. sqlite:///runs/fedring.db or "
            "postgresql+psycopg://user:password@host:5432/dbname"
        ) from None
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def absolute_url(url: str) -> str:
    """``url`` with a relative SQLite file made absolute against the working directory, so
    that a message can say where the store is."""
    parsed = parse_url(url)
    path = _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
    if path is None or path.is_absolute():
        return url
    return parsed.set(database=str(path.resolve())).render_as_string(hide_password=False)


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and messages."""
    return parse_url(url).render_as_string(hide_password=True)


def _sqlite_file(parsed: URL) -> Path | None:
    db = parsed.database
    if not db or db == ":memory:" or db.startswith("file:") or parsed.query.get("uri"):
        return None
    return Path(db).expanduser()


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA page_size=65536")  # takes effect only on a new, empty database
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def make_engine(parsed: URL, *, create: bool = True) -> Engine:
    """An engine with strict JSON, and for SQLite the pragmas, folder and pool above.

    A URL of a database SQLAlchemy has no dialect or driver for, or (``create=False``) a
    SQLite file that does not exist, fails with a one-line ``StoreUnavailable``."""
    try:
        return _make_engine(parsed, create=create)
    except NoSuchModuleError:
        raise StoreUnavailable(f"unsupported database URL {_shown(parsed)}: the store takes "
                               f"{URL_FORMS}") from None
    except ImportError as exc:
        raise StoreUnavailable(
            f"the driver for {parsed.drivername}:// (module {exc.name}) is not installed; the "
            f"store runs on SQLite and PostgreSQL (psycopg 3, installed with fedring): "
            f"{URL_FORMS}") from None
    except OSError as exc:
        raise StoreUnavailable(f"cannot create the SQLite file of {_shown(parsed)}: "
                               f"{exc.strerror} ({exc.filename})") from None


def _shown(parsed: URL) -> str:
    return parsed.render_as_string(hide_password=True)


def _make_engine(parsed: URL, *, create: bool) -> Engine:
    kwargs: dict[str, Any] = {
        # Strict JSON on every back end; non-finite floats were already turned into strings.
        "json_serializer": partial(json.dumps, allow_nan=False),
    }
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        kwargs["connect_args"] = {"timeout": 30.0}
        if path is not None and not create and not path.is_file():
            raise StoreUnavailable(f"there is no run store at {path} (no such file); give the "
                                   "--db of the runs, e.g. sqlite:///runs/fedring.db")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not parsed.database or parsed.database == ":memory:":
            # One shared connection, so every thread sees the same in-memory database.
            kwargs["poolclass"] = StaticPool
            kwargs["connect_args"]["check_same_thread"] = False
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    kwargs["pool_pre_ping"] = True
    return create_engine(parsed, **kwargs)


def create_schema(engine: Engine) -> None:
    """Create the tables that are missing (also when another process races us to it); a
    server that does not answer fails with a one-line ``StoreUnavailable``."""
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        url = engine.url
        reason = str(exc.orig).strip().splitlines()[0]
        if url.get_backend_name() == "sqlite":
            raise StoreUnavailable(f"cannot open {_shown(url)}: {reason}") from None
        raise StoreUnavailable(
            f"the database server is not reachable at {url.host or 'localhost'}:"
            f"{url.port or 5432} ({reason}); start it or fix the --db URL") from None
    try:
        Base.metadata.create_all(engine)
    except DBAPIError:
        # Another process may have created the tables between our check and our CREATE.
        existing = set(inspect(engine).get_table_names())
        if not set(Base.metadata.tables) <= existing:
            raise
    check_columns(engine)


def check_columns(engine: Engine) -> None:
    """Raise StoreUnavailable, naming the upgrade command, when a table of an existing
    store lacks a column of the models (a store made by an older fedring): otherwise the
    first write to that column would fail mid-run."""
    found = inspect(engine)
    for name, table in Base.metadata.tables.items():
        have = {c["name"] for c in found.get_columns(name)}
        missing = [c.name for c in table.columns if c.name not in have]
        if missing:
            url = _shown(engine.url)
            raise StoreUnavailable(
                f"{url}: the store's schema is older than this fedring's (table {name} has "
                f"no column {', '.join(missing)}); upgrade it with: python -m "
                f"server.store.migrations upgrade --db '{url}'")
