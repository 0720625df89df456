"""The run store's repository: ``Store``, its queries and writes.

``Store(url)`` opens the database (``engine``) and creates a missing schema. Every public
method is its own transaction; ``record_round`` writes the round row and all its update
rows atomically. ``save_checkpoint_in_background`` writes a checkpoint on a writer thread
(``checkpoints``), off the caller's critical path; the store's later writes of rounds and
runs, and its checkpoint reads, wait for that write first, so writes stay in order. Values
are checked and coded as ``values`` describes; time stamps are aware UTC datetimes.

Recording a round that is already recorded replaces it (the round row, its updates and its
evaluations), and saving a checkpoint for a round that already has one replaces that
checkpoint. That is what a resumed run does when it replays rounds after its last
checkpoint.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cache, partial
from typing import Any
from uuid import uuid4

import numpy as np
from sqlalchemy import bindparam, delete, func, insert, select
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from .checkpoints import BackgroundWriter, check_checkpoint_args, seal, unseal
from .engine import create_schema, make_engine, parse_url
from .errors import StoreError, UnknownRun
from .models import (
    SECAGG_SECURITY,
    SEMI_HONEST,
    Base,
    CheckpointRow,
    EvalRow,
    LedgerRow,
    RoundRow,
    RunRow,
    SecAggRoundRow,
    UpdateRow,
)
from .records import (
    FATES,
    FINAL_RUN_STATUSES,
    ROUND_STATUSES,
    Checkpoint,
    EvalRecord,
    RoundInfo,
    RunInfo,
    UpdateRecord,
    from_row,
    row_dict,
)
from .values import (
    check_int,
    check_status,
    float_column,
    from_json,
    metrics_from_json,
    metrics_to_json,
    to_json,
)

_clock_lock = threading.Lock()
_clock_last = datetime.min.replace(tzinfo=UTC)


_INSERT_ROUND = RoundRow.__table__.insert()
_INSERT_UPDATES = UpdateRow.__table__.insert()
_INSERT_EVALUATIONS = EvalRow.__table__.insert()
_RUN_EXISTS = select(RunRow.__table__.c.run_id).where(
    RunRow.__table__.c.run_id == bindparam("run_id"))
_checkpoints = CheckpointRow.__table__
_INSERT_CHECKPOINT = _checkpoints.insert()
_PRUNE_CHECKPOINTS = _checkpoints.delete().where(  # all but the run's ``keep`` newest
    _checkpoints.c.run_id == bindparam("run_id"),
    _checkpoints.c.id.not_in(
        select(_checkpoints.c.id).where(_checkpoints.c.run_id == bindparam("run_id"))
        .order_by(_checkpoints.c.round.desc(), _checkpoints.c.id.desc())
        .limit(bindparam("keep")).scalar_subquery()))
# A checkpoint smaller than this is written at once rather than on the writer thread: its
# write is mostly Python (SQLAlchemy), which a thread cannot overlap under the GIL, and a
# writer holding the GIL stalls the caller's next steps by more than the write costs
# (measured: 1.4 ms written at once against about 3 ms of stalls at 40 KB).
BACKGROUND_MIN_BYTES = 1 << 20


@cache
def _delete_round_of(table: type[Base]) -> Any:
    """DELETE FROM table WHERE run_id = :run_id AND round = :round (made once a table)."""
    t = table.__table__
    return t.delete().where(t.c.run_id == bindparam("run_id"), t.c.round == bindparam("round"))


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


class Store:
    """SQL store of runs. Thread-safe: every call uses its own session."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        """Open the store at ``url``; ``create=False``: a SQLite file must exist already."""
        self.url = url
        self._parsed = parse_url(url)
        self._engine = make_engine(self._parsed, create=create)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._closed = False
        self._writer = BackgroundWriter()
        try:
            create_schema(self._engine)
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
            self._writer.shutdown()
            self._engine.dispose()

    def flush(self) -> None:
        """Wait for the background checkpoint write, if one is in flight; a failed write
        raises its error here (once)."""
        self._writer.wait()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session(self) -> Session:
        if self._closed:
            raise StoreError(f"store {self.display_url()} is closed")
        return self._sessions()

    @staticmethod
    def _delete_round(s: Session, table: type[Base], run_id: str, rnd: int) -> None:
        """Delete a run's rows of round ``rnd`` in ``table`` (before it is recorded again):
        one prepared statement of the table's, not an ORM delete that would look for the
        rows among the session's objects (a write's session holds none of them)."""
        s.execute(_delete_round_of(table), {"run_id": run_id, "round": rnd})

    def _check_run(self, s: Session, run_id: str) -> None:
        """UnknownRun unless the run exists (without loading its row and config)."""
        if not isinstance(run_id, str) or s.execute(_RUN_EXISTS, {"run_id": run_id}).first() \
                is None:
            raise UnknownRun(f"no run {run_id!r} in {self.display_url()}")

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
            seed=check_int(seed, "seed"),
            config=to_json(config, "config"),
            summary=None,
        )
        with self._session() as s, s.begin():
            s.add(row)
        return row.run_id

    def finish_run(self, run_id: str, *, status: str, summary: dict | None = None) -> None:
        """Mark a run completed, failed or stopped, with an optional summary."""
        check_status(status, FINAL_RUN_STATUSES, "final run status")
        if summary is not None and not isinstance(summary, Mapping):
            raise TypeError(f"summary must be a dict or None, got {type(summary).__name__}")
        encoded = None if summary is None else to_json(summary, "summary")
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
        rnd = check_int(after_round, "after_round")
        self.flush()
        with self._session() as s, s.begin():
            row = self._run_row(s, run_id)
            row.status = "running"
            row.finished_at = None
            row.summary = None
            for table in (LedgerRow, SecAggRoundRow, UpdateRow, EvalRow, RoundRow):
                s.execute(delete(table).where(table.run_id == run_id, table.round > rnd))

    def _run_info(self, row: RunRow, num_rounds: int) -> RunInfo:
        return from_row(RunInfo, row, config=from_json(row.config),
                       summary=None if row.summary is None else from_json(row.summary),
                       num_rounds=int(num_rounds))

    def list_runs(self) -> list[RunInfo]:
        """All runs, newest first."""
        counts = (
            select(RoundRow.run_id, func.count().label("n")).where(RoundRow.round > 0)
            .group_by(RoundRow.run_id).subquery()
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
            n = s.scalar(select(func.count()).where(RoundRow.run_id == run_id,
                                                    RoundRow.round > 0))
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
        evaluations: Sequence[EvalRecord] = (),
    ) -> None:
        """Record one round, the fate of each of its updates and each client's answer in
        its federated evaluation, in one transaction.

        ``started_at`` defaults to now minus ``wall_s``. A round recorded again replaces
        the earlier record (round row, updates and evaluations).
        """
        rnd = check_int(round, "round", minimum=0)
        where = f"round {rnd}"
        if not isinstance(wall_s, numbers.Real) or not (
            math.isfinite(float(wall_s)) and float(wall_s) >= 0
        ):
            raise ValueError(f"{where}: wall_s must be a finite number >= 0, got {wall_s!r}")
        if started_at is not None and (
            not isinstance(started_at, datetime) or started_at.tzinfo is None
        ):
            raise ValueError(f"{where}: started_at must be an aware datetime, got {started_at!r}")
        round_row = dict(
            run_id=run_id,
            round=rnd,
            model_version=check_int(model_version, f"{where}: model_version", minimum=0),
            status=check_status(status, ROUND_STATUSES, f"{where}: status"),
            num_sampled=check_int(num_sampled, f"{where}: num_sampled", minimum=0),
            num_replies=check_int(num_replies, f"{where}: num_replies", minimum=0),
            num_accepted=check_int(num_accepted, f"{where}: num_accepted", minimum=0),
            num_rejected=check_int(num_rejected, f"{where}: num_rejected", minimum=0),
            num_dropped=check_int(num_dropped, f"{where}: num_dropped", minimum=0),
            metrics=metrics_to_json(metrics, f"{where}: metrics"),
            wall_s=float(wall_s),
            started_at=started_at or (_now() - timedelta(seconds=float(wall_s))),
        )
        if isinstance(updates, UpdateRecord | str | bytes | Mapping):
            raise TypeError(f"{where}: updates must be a sequence of UpdateRecord")
        rows = [self._update_row(run_id, rnd, i, u) for i, u in enumerate(updates)]
        if isinstance(evaluations, EvalRecord | str | bytes | Mapping):
            raise TypeError(f"{where}: evaluations must be a sequence of EvalRecord")
        evals = [self._eval_row(run_id, rnd, i, e) for i, e in enumerate(evaluations)]
        self.flush()  # a recorded round implies the checkpoint saved before it is complete
        with self._session() as s, s.begin():
            self._check_run(s, run_id)
            self._delete_round(s, UpdateRow, run_id, rnd)
            self._delete_round(s, EvalRow, run_id, rnd)
            self._delete_round(s, RoundRow, run_id, rnd)
            # the tables' own INSERTs (the updates' as one executemany), without the ORM's
            # unit of work: nothing here is read back as an object
            s.execute(_INSERT_ROUND, round_row)
            if rows:
                s.execute(_INSERT_UPDATES, rows)
            if evals:
                s.execute(_INSERT_EVALUATIONS, evals)

    @staticmethod
    def _update_row(run_id: str, rnd: int, i: int, u: Any) -> dict[str, Any]:
        where = f"round {rnd}, update {i}"
        if not isinstance(u, UpdateRecord):
            raise TypeError(f"{where} is a {type(u).__name__}, not an UpdateRecord")
        where = f"round {rnd}, update of client {u.client_id!r}"
        if not isinstance(u.client_id, str):
            raise TypeError(f"{where}: client_id must be a str, got {type(u.client_id).__name__}")
        check_status(u.fate, FATES, f"{where}: fate")  # also when set past __post_init__
        if u.reason is not None and not isinstance(u.reason, str):
            raise TypeError(f"{where}: reason must be a str or None")
        return {
            "run_id": run_id,
            "round": rnd,
            "client_id": u.client_id,
            "num_examples": check_int(
                u.num_examples, f"{where}: num_examples", minimum=0, nullable=True
            ),
            "base_version": check_int(u.base_version, f"{where}: base_version", nullable=True,
                                      bits=32),
            "staleness": check_int(u.staleness, f"{where}: staleness", nullable=True, bits=32),
            "norm": float_column(u.norm, f"{where}: norm"),
            "weight": float_column(u.weight, f"{where}: weight"),
            "fate": u.fate,
            "reason": u.reason,
            "metrics": metrics_to_json(u.metrics, f"{where}: metrics"),
        }

    @staticmethod
    def _eval_row(run_id: str, rnd: int, i: int, e: Any) -> dict[str, Any]:
        if not isinstance(e, EvalRecord):
            raise TypeError(f"round {rnd}, evaluation {i} is a {type(e).__name__}, not an "
                            "EvalRecord")
        where = f"round {rnd}, evaluation of client {e.client_id!r}"
        if not isinstance(e.client_id, str):
            raise TypeError(f"{where}: client_id must be a str, got {type(e.client_id).__name__}")
        check_status(e.fate, FATES, f"{where}: fate")
        if e.reason is not None and not isinstance(e.reason, str):
            raise TypeError(f"{where}: reason must be a str or None")
        row: dict[str, Any] = {
            "run_id": run_id, "round": rnd, "client_id": e.client_id, "fate": e.fate,
            "reason": e.reason,
            "num_examples": check_int(e.num_examples, f"{where}: num_examples", minimum=0,
                                      nullable=True)}
        for key in ("loss", "accuracy", "loss_personal", "accuracy_personal"):
            row[key] = float_column(getattr(e, key), f"{where}: {key}")
        return row

    def rounds(self, run_id: str) -> list[RoundInfo]:
        """The recorded rounds of a run, in round order."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(
                select(RoundRow).where(RoundRow.run_id == run_id).order_by(RoundRow.round)
            ).all()
        return [from_row(RoundInfo, r, metrics=metrics_from_json(r.metrics)) for r in rows]

    def updates(self, run_id: str, *, round: int | None = None) -> list[tuple[int, UpdateRecord]]:
        """``(round, record)`` for every update of a run (or of one round), in order."""
        query = select(UpdateRow).where(UpdateRow.run_id == run_id)
        if round is not None:
            query = query.where(UpdateRow.round == check_int(round, "round"))
        query = query.order_by(UpdateRow.round, UpdateRow.id)
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(query).all()
        return [(u.round, from_row(UpdateRecord, u, metrics=metrics_from_json(u.metrics)))
                for u in rows]

    def evaluations(self, run_id: str, *,
                    round: int | None = None) -> list[tuple[int, EvalRecord]]:
        """``(round, record)`` for every client's answer in the run's federated evaluation
        rounds (or in one round), in order."""
        query = select(EvalRow).where(EvalRow.run_id == run_id)
        if round is not None:
            query = query.where(EvalRow.round == check_int(round, "round"))
        query = query.order_by(EvalRow.round, EvalRow.id)
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(query).all()
        return [(e.round, from_row(EvalRecord, e)) for e in rows]

    # ---- privacy ledger

    def record_privacy(self, run_id: str, *, round: int, mode: str, accountant: str,
                       epsilon: float, delta: float, noise_multiplier: float, clip: float,
                       sampling_rate: float, epsilon_model: float | None = None,
                       protects_against: str | None = None, relation: str | None = None,
                       epsilon_replace_one: float | None = None,
                       relation_model: str | None = None) -> None:
        """Record the (epsilon, delta) a run has spent after ``round`` (replaces a re-record):
        ``epsilon`` against ``protects_against`` under ``relation``, ``epsilon_replace_one``
        (optional) against the same party under replace-one, ``epsilon_model`` (optional)
        against the released model's consumers under ``relation_model``."""
        values: dict[str, Any] = {
            "run_id": run_id, "round": check_int(round, "round"), "mode": str(mode),
            "accountant": str(accountant)}
        for key, text in (("protects_against", protects_against), ("relation", relation),
                          ("relation_model", relation_model)):
            values[key] = None if text is None else str(text)
        optional = ("epsilon_model", "epsilon_replace_one")
        for key, value in (("epsilon", epsilon), ("delta", delta),
                           ("noise_multiplier", noise_multiplier), ("clip", clip),
                           ("sampling_rate", sampling_rate), ("epsilon_model", epsilon_model),
                           ("epsilon_replace_one", epsilon_replace_one)):
            if value is None and key in optional:
                values[key] = None
                continue
            number = float(value)
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"ledger {key} must be a finite number >= 0, got {value!r}")
            values[key] = number
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            self._delete_round(s, LedgerRow, run_id, values["round"])
            s.execute(insert(LedgerRow).values(**values))

    def privacy_ledger(self, run_id: str) -> list[dict[str, Any]]:
        """The ledger entries of a run, in round order."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(select(LedgerRow).where(LedgerRow.run_id == run_id)
                             .order_by(LedgerRow.round)).all()
        return [row_dict(r) for r in rows]

    # ---- secure aggregation

    def record_secagg_round(self, run_id: str, *, round: int, status: str, k: int, t: int,
                            participants: Sequence[Any], dropouts: Mapping[str, Sequence[Any]],
                            survivors: Sequence[Any], rejected: Mapping[Any, str],
                            excluded: Mapping[Any, str] | None = None,
                            abort_reason: str | None = None,
                            seconds: Mapping[str, float] | None = None,
                            security: str = SEMI_HONEST) -> None:
        """Record one secure round (replaces a re-record): status "completed" or "aborted".

        Client ids are stored as strings; ``dropouts`` maps a stage name to its dropouts;
        ``security`` is the session's threat model ("semi_honest" or "malicious").
        """
        rnd = check_int(round, "round", minimum=0)
        where = f"secure round {rnd}"
        values = {
            "run_id": run_id, "round": rnd,
            "status": check_status(status, ("completed", "aborted"), f"{where}: status"),
            "k": check_int(k, f"{where}: k", minimum=0),
            "t": check_int(t, f"{where}: t", minimum=0),
            "num_participants": len(participants), "num_survivors": len(survivors),
            "participants": [str(c) for c in participants],
            "dropouts": {str(stage): [str(c) for c in ids] for stage, ids in dropouts.items()},
            "survivors": [str(c) for c in survivors],
            "rejected": {str(c): str(why) for c, why in rejected.items()},
            "excluded": {str(c): str(why) for c, why in (excluded or {}).items()},
            "abort_reason": None if abort_reason is None else str(abort_reason),
            "seconds": metrics_to_json(seconds, f"{where}: seconds"),
            "security": check_status(security, SECAGG_SECURITY, f"{where}: security"),
        }
        with self._session() as s, s.begin():
            self._run_row(s, run_id)
            self._delete_round(s, SecAggRoundRow, run_id, rnd)
            s.execute(insert(SecAggRoundRow).values(**values))

    def secagg_rounds(self, run_id: str) -> list[dict[str, Any]]:
        """The secure rounds of a run, in round order, as dicts of the recorded fields."""
        with self._session() as s:
            self._run_row(s, run_id)
            rows = s.scalars(select(SecAggRoundRow).where(SecAggRoundRow.run_id == run_id)
                             .order_by(SecAggRoundRow.round)).all()
        return [row_dict(r, seconds=metrics_from_json(r.seconds)) for r in rows]

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
        rnd, version, keep = check_checkpoint_args(round, model_version, keep, params)
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
        """``save_checkpoint`` on a writer thread, off the caller's critical path (one of
        fewer than ``BACKGROUND_MIN_BYTES`` of parameters is written at once: see there).

        ``params`` and ``state`` are copied before this returns, so the caller may change
        them at once. At most one write is in flight: this call, the store's later writes
        of rounds and runs, and its checkpoint reads wait for the previous one first, so a
        crash loses at most the checkpoint being written and resume finds the one before
        it. ``flush()`` (and ``close()``) wait for the write and raise its error, if any.
        """
        rnd, version, keep = check_checkpoint_args(round, model_version, keep, params)
        self.flush()
        if self._closed:
            raise StoreError(f"store {self.display_url()} is closed")
        if isinstance(self._engine.pool, StaticPool) or params.nbytes < BACKGROUND_MIN_BYTES:
            self._write_checkpoint(run_id, rnd, version, keep, params, state)  # one shared
            return  # in-memory connection, or too small to gain from a thread (see above)
        self._writer.submit(partial(self._write_checkpoint, run_id, rnd, version, keep),
                            params, state)

    def _write_checkpoint(self, run_id: str, rnd: int, version: int, keep: int,
                          params: np.ndarray, state: dict) -> str:
        payload, digest = seal(params, state)
        with self._session() as s, s.begin():  # the table's own statements, no ORM objects
            self._check_run(s, run_id)
            self._delete_round(s, CheckpointRow, run_id, rnd)
            s.execute(_INSERT_CHECKPOINT, dict(run_id=run_id, round=rnd, model_version=version,
                                               created_at=_now(), sha256=digest,
                                               payload=payload))
            s.execute(_PRUNE_CHECKPOINTS, {"run_id": run_id, "keep": keep})
        return digest

    def load_checkpoint(self, run_id: str, *, round: int | None = None) -> Checkpoint | None:
        """The checkpoint of ``round``, or the newest (highest round) if ``round`` is None;
        None if there is none. Raises CorruptCheckpoint if the payload fails its sha256."""
        query = select(CheckpointRow).where(CheckpointRow.run_id == run_id)
        if round is not None:
            query = query.where(CheckpointRow.round == check_int(round, "round"))
        query = query.order_by(CheckpointRow.round.desc(), CheckpointRow.id.desc()).limit(1)
        self.flush()
        with self._session() as s:
            self._run_row(s, run_id)
            row = s.scalars(query).first()
        if row is None:
            return None
        where = f"checkpoint of run {run_id!r} at round {row.round} in {self.display_url()}"
        params, state = unseal(bytes(row.payload), row.sha256, where)
        return from_row(Checkpoint, row, params=params, state=state)
