"""The run store: runs, rounds, per-update fates and checkpoints, behind one ``Store``.

``Store(url)`` takes any SQLAlchemy URL. A SQLite file (``sqlite:///runs/fedring.db``) is
the default: its folder is created, and every connection turns on WAL (so a reader, e.g.
``fedring show`` in another process, never blocks the running server and sees each
committed round), foreign keys, a 30 s busy timeout and ``synchronous=NORMAL`` (durable
against a crashed process, which is what resume needs). A new SQLite file gets 64 KiB
pages: a checkpoint of a million parameters is then about 70 page writes instead of 1,100
(three times faster here), and small round records got faster too. PostgreSQL works through
psycopg 3: ``postgresql+psycopg://user:pw@host:5432/db`` (a bare ``postgresql://`` is
taken to mean psycopg too). The schema is created with ``metadata.create_all``.

Every public method is its own transaction; ``record_round`` writes the round row and all
its update rows atomically. ``save_checkpoint_in_background`` writes a checkpoint on a
writer thread, off the caller's critical path; the store's later writes of rounds and runs,
and its checkpoint reads, wait for that write first, so writes stay in order.

Values and JSON
---------------
* Metrics (round and update) are dicts of ``str`` to numbers; every value is stored as a
  Python ``float`` (numpy scalars and ints are converted). Anything else is a ValueError.
* JSON columns (``config``, ``summary``, ``metrics``) hold strict JSON, because
  PostgreSQL's ``json`` refuses the ``NaN``/``Infinity`` tokens. Non-finite floats are
  therefore stored as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (the
  spellings of Python's ``json`` module), in every JSON column alike, and are turned back
  into floats when read. The price: in ``config``/``summary`` a *string* value that is
  exactly one of those three words also reads back as a float.
* Float columns (``updates.norm``, ``updates.weight``): SQLite cannot store NaN in a REAL
  column (it silently becomes NULL), so NaN is stored as NULL on every back end and reads
  back as ``None``; ±infinity is stored as is.
* Time stamps are aware UTC datetimes.

Re-recording
------------
Recording a round that is already recorded replaces it (the round row and its updates),
and saving a checkpoint for a round that already has one replaces that checkpoint. That
is what a resumed run does when it replays rounds after its last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import numpy as np
from sqlalchemy import create_engine, delete, event, func, insert, inspect, select
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from .models import (
    Base,
    CheckpointRow,
    LedgerRow,
    RoundRow,
    RunRow,
    SecAggRoundRow,
    UpdateRow,
)
from .serialize import pack_state, unpack_state

RUN_STATUSES = ("running", "completed", "failed", "stopped")
FINAL_RUN_STATUSES = ("completed", "failed", "stopped")
ROUND_STATUSES = ("completed", "aborted", "failed")
FATES = ("accepted", "rejected", "dropped")

_INT64 = (-(2**63), 2**63 - 1)
_R = TypeVar("_R")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base class of the store's own errors."""


class UnknownRun(StoreError, LookupError):
    """No run with that id in this database."""


class CorruptCheckpoint(StoreError):
    """A checkpoint's payload does not match its sha256, or cannot be decoded."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class UpdateRecord:
    """The fate of one client update in one round."""

    client_id: str
    fate: str  # "accepted" | "rejected" | "dropped"
    reason: str | None = None
    num_examples: int | None = None
    base_version: int | None = None
    staleness: int | None = None
    norm: float | None = None
    weight: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fate not in FATES:
            raise ValueError(
                f"update fate {self.fate!r} of client {self.client_id!r}: "
                f"must be one of {', '.join(FATES)}"
            )


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    name: str | None
    status: str
    seed: int
    created_at: datetime
    finished_at: datetime | None
    config: dict
    summary: dict | None
    num_rounds: int  # rounds recorded so far


@dataclass(frozen=True)
class RoundInfo:
    round: int
    model_version: int
    status: str
    num_sampled: int
    num_replies: int
    num_accepted: int
    num_rejected: int
    num_dropped: int
    metrics: dict[str, float]
    wall_s: float
    started_at: datetime | None = None


@dataclass(frozen=True)
class Checkpoint:
    round: int
    model_version: int
    params: np.ndarray  # flat float32
    state: dict
    sha256: str


# --------------------------------------------------------------------------- value checks


def _int(value: Any, what: str, *, minimum: int | None = None, nullable: bool = False) -> Any:
    if value is None and nullable:
        return None
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be an integer, got a bool")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {out}")
    if not _INT64[0] <= out <= _INT64[1]:
        raise ValueError(f"{what} {out} does not fit in 64 bits")
    return out


def _checkpoint_args(rnd: Any, version: Any, keep: Any,
                     params: Any) -> tuple[int, int, int]:
    """Checked (round, model_version, keep) of a checkpoint; params must be flat float32."""
    checked = (_int(rnd, "round", minimum=0), _int(version, "model_version", minimum=0),
               _int(keep, "keep", minimum=1))
    if not isinstance(params, np.ndarray) or params.ndim != 1 or params.dtype != np.float32:
        desc = (
            f"{params.dtype} array of shape {params.shape}"
            if isinstance(params, np.ndarray)
            else type(params).__name__
        )
        raise ValueError(f"params must be a flat float32 numpy array, got a {desc}")
    return checked


def _float_column(value: Any, what: str) -> float | None:
    """A nullable Float column: NaN is stored as NULL (see the module docstring)."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    out = float(value)
    return None if math.isnan(out) else out


def _json_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _to_json(value: Any, where: str) -> Any:
    """Plain JSON (dicts with str keys, lists, str, int, float, bool, None), non-finite
    floats as strings; numpy scalars/arrays and tuples are converted."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _json_float(float(value))
    if isinstance(value, np.generic):
        return _to_json(value.item(), where)
    if isinstance(value, np.ndarray):
        return _to_json(value.tolist(), where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out = {}
        for key, sub in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: key {key!r} is a {type(key).__name__}; JSON keys must be str"
                )
            out[str(key)] = _to_json(sub, f"{where}.{key}")
        return out
    if isinstance(value, list | tuple):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot be stored as JSON")


def _from_json(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _metrics_to_json(metrics: Mapping[str, Any] | None, where: str) -> dict[str, float | str]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} must be a dict of numbers, got {type(metrics).__name__}")
    out: dict[str, float | str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; must be str")
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"{where}[{key!r}] is {value!r:.60} ({type(value).__name__}); "
                "metrics must be numbers"
            )
        out[key] = _json_float(float(value))
    return out


def _metrics_from_json(metrics: dict | None) -> dict[str, float]:
    if not metrics:
        return {}
    return {k: (_NONFINITE[v] if isinstance(v, str) else float(v)) for k, v in metrics.items()}


def _status(value: Any, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r}: must be one of {', '.join(allowed)}")
    return value


def _record(cls: type[_R], row: Base, **converted: Any) -> _R:
    """Dataclass ``cls`` from ``row``: each field from the column of its name, except
    those given in ``converted`` (values decoded from JSON, or not columns at all)."""
    columns = {f.name: getattr(row, f.name) for f in fields(cls) if f.name not in converted}
    return cls(**columns, **converted)


# --------------------------------------------------------------------------- time

_clock_lock = threading.Lock()
_clock_last = datetime.min.replace(tzinfo=UTC)


def _now() -> datetime:
    return datetime.now(UTC)


def _now_strict() -> datetime:
    """Now, but strictly later than the previous call in this process (newest-first order
    of runs created in the same microsecond)."""
    global _clock_last
    with _clock_lock:
        now = datetime.now(UTC)
        if now <= _clock_last:
            now = _clock_last + timedelta(microseconds=1)
        _clock_last = now
        return now


# --------------------------------------------------------------------------- engine


def _normalise_url(url: str) -> URL:
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


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and messages."""
    return _normalise_url(url).render_as_string(hide_password=True)


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


def _make_engine(parsed: URL) -> Engine:
    kwargs: dict[str, Any] = {
        # Strict JSON on every back end; non-finite floats were already turned into strings.
        "json_serializer": partial(json.dumps, allow_nan=False),
    }
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        kwargs["connect_args"] = {"timeout": 30.0}
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


def _create_schema(engine: Engine) -> None:
    try:
        Base.metadata.create_all(engine)
    except DBAPIError:
        # Another process may have created the tables between our check and our CREATE.
        existing = set(inspect(engine).get_table_names())
        if not set(Base.metadata.tables) <= existing:
            raise


# --------------------------------------------------------------------------- store


class Store:
    """SQL store of runs. Thread-safe: every call uses its own session."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._parsed = _normalise_url(url)
        self._engine = _make_engine(self._parsed)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._closed = False
        # Background checkpoints: one writer thread, at most one write in flight.
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: Future[str] | None = None
        self._snapshot: np.ndarray | None = None  # params copy reused by background saves
        try:
            _create_schema(self._engine)
        except BaseException:
            self._engine.dispose()
            raise

    # ---- housekeeping

    def display_url(self) -> str:
        """The URL with any password masked (safe to print and log)."""
        return self._parsed.render_as_string(hide_password=True)

    def __repr__(self) -> str:
        return f"Store({self.display_url()!r})"

    def close(self) -> None:
        """Finish a background checkpoint (raising its error, if any) and close."""
        try:
            self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.shutdown()
            self._engine.dispose()

    def flush(self) -> None:
        """Wait for the background checkpoint write, if one is in flight; a failed write
        raises its error here (once)."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session(self) -> Session:
        if self._closed:
            raise StoreError(f"store {self.display_url()} is closed")
        return self._sessions()

    def _run_row(self, s: Session, run_id: str) -> RunRow:
        row = s.get(RunRow, run_id) if isinstance(run_id, str) else None
        if row is None:
            raise UnknownRun(f"no run {run_id!r} in {self.display_url()}")
        return row

    # ---- runs

    def create_run(self, *, config: dict, seed: int, name: str | None = None) -> str:
        """Start a run (status "running") and return its id, e.g. ``'r3f9c0a1b2d4e'``."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"run name must be a str, got {type(name).__name__}")
        row = RunRow(
            run_id="r" + uuid4().hex[:12],
            name=name,
            created_at=_now_strict(),
            finished_at=None,
            status="running",
            seed=_int(seed, "seed"),
            config=_to_json(config, "config"),
            summary=None,
        )
        with self._session() as s, s.begin():
            s.add(row)
        return row.run_id

    def finish_run(self, run_id: str, *, status: str, summary: dict | None = None) -> None:
        """Mark a run completed, failed or stopped, with an optional summary."""
        _status(status, FINAL_RUN_STATUSES, "final run status")
        if summary is not None and not isinstance(summary, Mapping):
            raise TypeError(f"summary must be a dict or None, got {type(summary).__name__}")
        encoded = None if summary is None else _to_json(summary, "summary")
        try:
            self.flush()  # a failed checkpoint write raises, after the status is written
        finally:
            with self._session() as s, s.begin():
                row = self._run_row(s, run_id)
                row.status = status
                row.finished_at = _now()
                row.summary = encoded

    def reopen_run(self, run_id: str, *, after_round: int) -> None:
        """Mark a run running again to resume it after ``after_round`` (its last checkpoint).

        Rounds and ledger entries recorded after that round are deleted: the resumed run
        records them again, so none is counted twice.
        """
        rnd = _int(after_round, "after_round")
        self.flush()
        with self._session() as s, s.begin():
            row = self._run_row(s, run_id)
            row.status = "running"
            row.finished_at = None
            row.summary = None
            s.execute(delete(LedgerRow).where(LedgerRow.run_id == run_id, LedgerRow.round > rnd))
            s.execute(delete(SecAggRoundRow).where(SecAggRoundRow.run_id == run_id,
                                                   SecAggRoundRow.round > rnd))
            s.execute(delete(UpdateRow).where(UpdateRow.run_id == run_id, UpdateRow.round > rnd))
            s.execute(delete(RoundRow).where(RoundRow.run_id == run_id, RoundRow.round > rnd))

    def _run_info(self, row: RunRow, num_rounds: int) -> RunInfo:
        return _record(RunInfo, row, config=_from_json(row.config),
                       summary=None if row.summary is None else _from_json(row.summary),
                       num_rounds=int(num_rounds))

    def list_runs(self) -> list[RunInfo]:
        """All runs, newest first."""
        counts = (
            select(RoundRow.run_id, func.count().label("n")).group_by(RoundRow.run_id).subquery()
        )
        query = (
            select(RunRow, func.coalesce(counts.c.n, 0))
            .outerjoin(counts, counts.c.run_id == RunRow.run_id)
            .order_by(RunRow.created_at.desc(), RunRow.run_id.desc())
        )
        with self._session() as s:
            return [self._run_info(row, n) for row, n in s.execute(query).all()]

    def get_run(self, run_id: str) -> RunInfo:
        with self._session() as s:
            row = self._run_row(s, run_id)
            n = s.scalar(select(func.count()).where(RoundRow.run_id == run_id))
            return self._run_info(row, n or 0)

    # ---- rounds and updates

    def record_round(
        self,
        run_id: str,
        *,
        round: int,
        model_version: int,
        status: str = "completed",
        num_sampled: int = 0,
        num_replies: int = 0,
        num_accepted: int = 0,
        num_rejected: int = 0,
        num_dropped: int = 0,
        metrics: dict[str, float] | None = None,
        wall_s: float = 0.0,
        updates: Sequence[UpdateRecord] = (),
        started_at: datetime | None = None,
    ) -> None:
        """Record one round and the fate of each of its updates, in one transaction.

        ``started_at`` defaults to now minus ``wall_s``. A round recorded again replaces
        the earlier record (round row and updates).
        """
        rnd = _int(round, "round", minimum=0)
        where = f"round {rnd}"
        if not isinstance(wall_s, numbers.Real) or not (
            math.isfinite(float(wall_s)) and float(wall_s) >= 0
        ):
            raise ValueError(f"{where}: wall_s must be a finite number >= 0, got {wall_s!r}")
        if started_at is not None and (
            not isinstance(started_at, datetime) or started_at.tzinfo is None
        ):
            raise ValueError(f"{where}: started_at must be an aware datetime, got {started_at!r}")
        round_row = RoundRow(
            run_id=run_id,
            round=rnd,
            model_version=_int(model_version, f"{where}: model_version", minimum=0),
            status=_status(status, ROUND_STATUSES, f"{where}: status"),
            num_sampled=_int(num_sampled, f"{where}: num_sampled", minimum=0),
            num_replies=_int(num_replies, f"{where}: num_replies", minimum=0),
            num_accepted=_int(num_accepted, f"{where}: num_accepted", minimum=0),
            num_rejected=_int(num_rejected, f"{where}: num_rejected", minimum=0),
            num_dropped=_int(num_dropped, f"{where}: num_dropped", minimum=0),
            metrics=_metrics_to_json(metrics, f"{where}: metrics"),
            wall_s=float(wall_s),
            started_at=started_at or (_now() - timedelta(seconds=float(wall_s))),
        )
        if isinstance(updates, UpdateRecord | str | bytes | Mapping):
            raise TypeError(f"{where}: updates must be a sequence of UpdateRecord")
        rows = [self._update_row(run_id, rnd, i, u) for i, u in enumerate(updates)]
        self.flush()  # a recorded round implies the checkpoint saved before it is complete
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            s.execute(delete(UpdateRow).where(UpdateRow.run_id == run_id, UpdateRow.round == rnd))
            s.execute(delete(RoundRow).where(RoundRow.run_id == run_id, RoundRow.round == rnd))
            s.add(round_row)
            s.flush()
            if rows:
                s.execute(insert(UpdateRow), rows)

    @staticmethod
    def _update_row(run_id: str, rnd: int, i: int, u: Any) -> dict[str, Any]:
        where = f"round {rnd}, update {i}"
        if not isinstance(u, UpdateRecord):
            raise TypeError(f"{where} is a {type(u).__name__}, not an UpdateRecord")
        where = f"round {rnd}, update of client {u.client_id!r}"
        if not isinstance(u.client_id, str):
            raise TypeError(f"{where}: client_id must be a str, got {type(u.client_id).__name__}")
        _status(u.fate, FATES, f"{where}: fate")
        if u.reason is not None and not isinstance(u.reason, str):
            raise TypeError(f"{where}: reason must be a str or None")
        return {
            "run_id": run_id,
            "round": rnd,
            "client_id": u.client_id,
            "num_examples": _int(
                u.num_examples, f"{where}: num_examples", minimum=0, nullable=True
            ),
            "base_version": _int(u.base_version, f"{where}: base_version", nullable=True),
            "staleness": _int(u.staleness, f"{where}: staleness", nullable=True),
            "norm": _float_column(u.norm, f"{where}: norm"),
            "weight": _float_column(u.weight, f"{where}: weight"),
            "fate": u.fate,
            "reason": u.reason,
            "metrics": _metrics_to_json(u.metrics, f"{where}: metrics"),
        }

    def rounds(self, run_id: str) -> list[RoundInfo]:
        """The recorded rounds of a run, in round order."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(
                select(RoundRow).where(RoundRow.run_id == run_id).order_by(RoundRow.round)
            ).all()
        return [_record(RoundInfo, r, metrics=_metrics_from_json(r.metrics)) for r in rows]

    def updates(self, run_id: str, *, round: int | None = None) -> list[tuple[int, UpdateRecord]]:
        """``(round, record)`` for every update of a run (or of one round), in order."""
        query = select(UpdateRow).where(UpdateRow.run_id == run_id)
        if round is not None:
            query = query.where(UpdateRow.round == _int(round, "round"))
        query = query.order_by(UpdateRow.round, UpdateRow.id)
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(query).all()
        return [(u.round, _record(UpdateRecord, u, metrics=_metrics_from_json(u.metrics)))
                for u in rows]

    # ---- privacy ledger

    def record_privacy(self, run_id: str, *, round: int, mode: str, accountant: str,
                       epsilon: float, delta: float, noise_multiplier: float, clip: float,
                       sampling_rate: float, epsilon_model: float | None = None,
                       protects_against: str | None = None) -> None:
        """Record the (epsilon, delta) a run has spent after ``round`` (replaces a re-record):
        ``epsilon`` against ``protects_against``, ``epsilon_model`` (optional) against the
        released model's consumers."""
        values: dict[str, Any] = {
            "run_id": run_id, "round": _int(round, "round"), "mode": str(mode),
            "accountant": str(accountant), "epsilon_model": None,
            "protects_against": None if protects_against is None else str(protects_against)}
        for key, value in (("epsilon", epsilon), ("delta", delta),
                           ("noise_multiplier", noise_multiplier), ("clip", clip),
                           ("sampling_rate", sampling_rate), ("epsilon_model", epsilon_model)):
            if value is None and key == "epsilon_model":
                continue
            number = float(value)
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"ledger {key} must be a finite number >= 0, got {value!r}")
            values[key] = number
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            s.execute(delete(LedgerRow).where(LedgerRow.run_id == run_id,
                                              LedgerRow.round == values["round"]))
            s.execute(insert(LedgerRow).values(**values))

    def privacy_ledger(self, run_id: str) -> list[dict[str, Any]]:
        """The ledger entries of a run, in round order."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(select(LedgerRow).where(LedgerRow.run_id == run_id)
                             .order_by(LedgerRow.round)).all()
        return [{"round": r.round, "mode": r.mode, "accountant": r.accountant,
                 "epsilon": r.epsilon, "delta": r.delta,
                 "noise_multiplier": r.noise_multiplier, "clip": r.clip,
                 "sampling_rate": r.sampling_rate, "epsilon_model": r.epsilon_model,
                 "protects_against": r.protects_against} for r in rows]

    # ---- secure aggregation

    def record_secagg_round(self, run_id: str, *, round: int, status: str, k: int, t: int,
                            participants: Sequence[Any], dropouts: Mapping[str, Sequence[Any]],
                            survivors: Sequence[Any], rejected: Mapping[Any, str],
                            excluded: Mapping[Any, str] | None = None,
                            abort_reason: str | None = None,
                            seconds: Mapping[str, float] | None = None) -> None:
        """Record one secure round (replaces a re-record): status "completed" or "aborted".

        Client ids are stored as strings; ``dropouts`` maps a stage name to its dropouts.
        """
        rnd = _int(round, "round", minimum=0)
        where = f"secure round {rnd}"
        values = {
            "run_id": run_id, "round": rnd,
            "status": _status(status, ("completed", "aborted"), f"{where}: status"),
            "k": _int(k, f"{where}: k", minimum=0), "t": _int(t, f"{where}: t", minimum=0),
            "num_participants": len(participants), "num_survivors": len(survivors),
            "participants": [str(c) for c in participants],
            "dropouts": {str(stage): [str(c) for c in ids] for stage, ids in dropouts.items()},
            "survivors": [str(c) for c in survivors],
            "rejected": {str(c): str(why) for c, why in rejected.items()},
            "excluded": {str(c): str(why) for c, why in (excluded or {}).items()},
            "abort_reason": None if abort_reason is None else str(abort_reason),
            "seconds": _metrics_to_json(seconds, f"{where}: seconds"),
        }
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            s.execute(delete(SecAggRoundRow).where(SecAggRoundRow.run_id == run_id,
                                                   SecAggRoundRow.round == rnd))
            s.execute(insert(SecAggRoundRow).values(**values))

    def secagg_rounds(self, run_id: str) -> list[dict[str, Any]]:
        """The secure rounds of a run, in round order, as dicts of the recorded fields."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(select(SecAggRoundRow).where(SecAggRoundRow.run_id == run_id)
                             .order_by(SecAggRoundRow.round)).all()
        return [{"round": r.round, "status": r.status, "k": r.k, "t": r.t,
                 "num_participants": r.num_participants, "num_survivors": r.num_survivors,
                 "participants": list(r.participants), "dropouts": dict(r.dropouts),
                 "survivors": list(r.survivors), "rejected": dict(r.rejected),
                 "excluded": dict(r.excluded), "abort_reason": r.abort_reason,
                 "seconds": _metrics_from_json(r.seconds)} for r in rows]

    # ---- checkpoints

    def save_checkpoint(
        self,
        run_id: str,
        *,
        round: int,
        model_version: int,
        params: np.ndarray,
        state: dict,
        keep: int = 2,
    ) -> str:
        """Store params (flat float32) and state; keep the ``keep`` newest checkpoints of
        the run (highest rounds) and delete older ones. Returns the payload's sha256 hex."""
        rnd, version, keep = _checkpoint_args(round, model_version, keep, params)
        self.flush()
        return self._write_checkpoint(run_id, rnd, version, keep, params, state)

    def save_checkpoint_in_background(
        self,
        run_id: str,
        *,
        round: int,
        model_version: int,
        params: np.ndarray,
        state: dict,
        keep: int = 2,
    ) -> None:
        """``save_checkpoint`` on a writer thread, off the caller's critical path.

        ``params`` and ``state`` are copied before this returns, so the caller may change
        them at once. At most one write is in flight: this call, the store's later writes
        of rounds and runs, and its checkpoint reads wait for the previous one first, so a
        crash loses at most the checkpoint being written and resume finds the one before
        it. ``flush()`` (and ``close()``) wait for the write and raise its error, if any.
        """
        rnd, version, keep = _checkpoint_args(round, model_version, keep, params)
        self.flush()
        if self._closed:
            raise StoreError(f"store {self.display_url()} is closed")
        if isinstance(self._engine.pool, StaticPool):  # one shared in-memory connection
            self._write_checkpoint(run_id, rnd, version, keep, params, state)
            return
        snapshot = self._snapshot
        if snapshot is None or snapshot.shape != params.shape:
            snapshot = self._snapshot = np.empty_like(params)
        np.copyto(snapshot, params)  # reused: the previous write has finished with it
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="fedring-checkpoint")
        self._in_flight = self._writer.submit(self._write_checkpoint, run_id, rnd, version,
                                              keep, snapshot, deepcopy(state))

    def _write_checkpoint(self, run_id: str, rnd: int, version: int, keep: int,
                          params: np.ndarray, state: dict) -> str:
        payload = pack_state(params, state)
        digest = hashlib.sha256(payload).hexdigest()
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            s.execute(
                delete(CheckpointRow).where(
                    CheckpointRow.run_id == run_id, CheckpointRow.round == rnd
                )
            )
            s.add(
                CheckpointRow(
                    run_id=run_id,
                    round=rnd,
                    model_version=version,
                    created_at=_now(),
                    sha256=digest,
                    payload=payload,
                )
            )
            s.flush()
            kept = s.scalars(
                select(CheckpointRow.id)
                .where(CheckpointRow.run_id == run_id)
                .order_by(CheckpointRow.round.desc(), CheckpointRow.id.desc())
                .limit(keep)
            ).all()
            s.execute(
                delete(CheckpointRow).where(
                    CheckpointRow.run_id == run_id, CheckpointRow.id.not_in(kept)
                )
            )
        return digest

    def load_checkpoint(self, run_id: str, *, round: int | None = None) -> Checkpoint | None:
        """The checkpoint of ``round``, or the newest (highest round) if ``round`` is None;
        None if there is none. Raises CorruptCheckpoint if the payload fails its sha256."""
        query = select(CheckpointRow).where(CheckpointRow.run_id == run_id)
        if round is not None:
            query = query.where(CheckpointRow.round == _int(round, "round"))
        query = query.order_by(CheckpointRow.round.desc(), CheckpointRow.id.desc()).limit(1)
        self.flush()
        with self._session() as s:
            self._run_row(s, run_id)
            row = s.scalars(query).first()
        if row is None:
            return None
        payload = bytes(row.payload)
        where = f"checkpoint of run {run_id!r} at round {row.round} in {self.display_url()}"
        digest = hashlib.sha256(payload).hexdigest()
        if digest != row.sha256:
            raise CorruptCheckpoint(
                f"{where} is corrupted: its payload ({len(payload)} bytes) has sha256 "
                f"{digest}, but {row.sha256} was recorded when it was saved"
            )
        try:
            params, state = unpack_state(payload)
        except ValueError as exc:
            raise CorruptCheckpoint(f"{where} cannot be decoded: {exc}") from exc
        return Checkpoint(
            round=row.round,
            model_version=row.model_version,
            params=params,
            state=state,
            sha256=row.sha256,
        )
