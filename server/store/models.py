"""ORM tables of the run store.

Portable column types only (String, BigInteger, Integer, Float, Boolean, DateTime with
time zone, JSON, LargeBinary), so the same schema works on SQLite and PostgreSQL.
Table and column names are part of the on-disk format: alembic migrations will start
from them, so rename nothing without a migration.

Time stamps are always stored and returned as time-zone-aware UTC datetimes (SQLite
has no time zone type; :class:`UTCDateTime` stores naive UTC there and re-attaches UTC
on the way out).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = ["Base", "CheckpointRow", "EvalRow", "LedgerRow", "RoundRow", "RunRow",
           "SecAggRoundRow", "UTCDateTime", "UpdateRow"]

SEMI_HONEST = "semi_honest"  # secagg_rounds.security of rows recorded before the column
SECAGG_SECURITY = (SEMI_HONEST, "malicious")  # secagg_rounds.security's values

# Explicit constraint names keep the schema stable across back ends (and alembic happy).
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}

# An autoincrementing 64-bit key on PostgreSQL; SQLite only autoincrements INTEGER.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that always hands back aware UTC datetimes."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: give a time zone (UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class RunRow(Base):
    """One federated training run."""

    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16))
    seed: Mapped[int] = mapped_column(BigInteger)
    config: Mapped[dict] = mapped_column(JSON)
    summary: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))


class RoundRow(Base):
    """One aggregation round (or one applied async aggregate) of a run."""

    __tablename__ = "rounds"

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    model_version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    num_sampled: Mapped[int] = mapped_column(Integer)
    num_replies: Mapped[int] = mapped_column(Integer)
    num_accepted: Mapped[int] = mapped_column(Integer)
    num_rejected: Mapped[int] = mapped_column(Integer)
    num_dropped: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(JSON)
    wall_s: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class PerClientOfRound:
    """Columns of a table with one row per client of a round (the round's row owns them)."""

    @declared_attr.directive
    def __table_args__(cls) -> tuple[Any, ...]:
        return (ForeignKeyConstraint(["run_id", "round"], ["rounds.run_id", "rounds.round"],
                                     ondelete="CASCADE"),
                Index(None, "run_id", "round"))

    # sort_order -1: these come before the table's own columns (the on-disk order).
    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True,
                                    sort_order=-1)
    run_id: Mapped[str] = mapped_column(String(32), sort_order=-1)
    round: Mapped[int] = mapped_column(Integer, sort_order=-1)
    client_id: Mapped[str] = mapped_column(String, sort_order=-1)


class UpdateRow(PerClientOfRound, Base):
    """What happened to one client update: accepted, rejected (with why) or dropped."""

    __tablename__ = "updates"

    num_examples: Mapped[int | None] = mapped_column(BigInteger)
    base_version: Mapped[int | None] = mapped_column(Integer)
    staleness: Mapped[int | None] = mapped_column(Integer)
    norm: Mapped[float | None] = mapped_column(Float)
    weight: Mapped[float | None] = mapped_column(Float)
    fate: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String)
    metrics: Mapped[dict] = mapped_column(JSON)


class EvalRow(PerClientOfRound, Base):
    """One client's answer in a federated evaluation round: its figures for the global
    model on its held-out split (and for its own model), or why there are none."""

    __tablename__ = "evaluations"

    fate: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String)
    num_examples: Mapped[int | None] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    accuracy: Mapped[float | None] = mapped_column(Float)
    loss_personal: Mapped[float | None] = mapped_column(Float)
    accuracy_personal: Mapped[float | None] = mapped_column(Float)


class OneRowPerRound:
    """Columns of a table with at most one row per round of a run (its own id as the key)."""

    @declared_attr.directive
    def __table_args__(cls) -> tuple[Any, ...]:
        return (UniqueConstraint("run_id", "round"),)

    # sort_order -1: these come before the table's own columns (the on-disk order).
    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True,
                                    sort_order=-1)
    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.run_id", ondelete="CASCADE"), index=True, sort_order=-1
    )
    round: Mapped[int] = mapped_column(Integer, sort_order=-1)


class CheckpointRow(OneRowPerRound, Base):
    """A server checkpoint: model parameters plus aggregator/optimizer state."""

    __tablename__ = "checkpoints"

    model_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    sha256: Mapped[str] = mapped_column(String(64))
    payload: Mapped[bytes] = mapped_column(LargeBinary)


class LedgerRow(OneRowPerRound, Base):
    """The privacy ledger: (epsilon, delta) spent by a run after each round.

    ``epsilon`` is stated against ``protects_against`` ("server" or "released model")
    under ``relation``; ``epsilon_replace_one``, when set, against the same party under
    replace-one; ``epsilon_model``, when set, against the released model's consumers
    (local and distributed DP) under ``relation_model``. NULL in rows written before
    revision 0002 (adversary, model figure) or 0003 (relations, replace-one figure).
    """

    __tablename__ = "privacy_ledger"

    mode: Mapped[str] = mapped_column(String(16))
    accountant: Mapped[str] = mapped_column(String(16))
    epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    noise_multiplier: Mapped[float] = mapped_column(Float)
    clip: Mapped[float] = mapped_column(Float)
    sampling_rate: Mapped[float] = mapped_column(Float)
    epsilon_model: Mapped[float | None] = mapped_column(Float, nullable=True)
    protects_against: Mapped[str | None] = mapped_column(String(32), nullable=True)
    relation: Mapped[str | None] = mapped_column(String(16), nullable=True)
    epsilon_replace_one: Mapped[float | None] = mapped_column(Float, nullable=True)
    relation_model: Mapped[str | None] = mapped_column(String(16), nullable=True)


class SecAggRoundRow(OneRowPerRound, Base):
    """One secure-aggregation round: who took part, who dropped at which stage, the outcome.

    Client ids are strings (as in ``updates``); ``dropouts`` maps each stage name to the
    clients that did not answer it, ``rejected`` and ``excluded`` map a client to why;
    ``security`` is the threat model the session held against ("semi_honest" or
    "malicious"; rows from before it was recorded read "semi_honest").
    """

    __tablename__ = "secagg_rounds"

    status: Mapped[str] = mapped_column(String(16))
    k: Mapped[int] = mapped_column(Integer)
    t: Mapped[int] = mapped_column(Integer)
    num_participants: Mapped[int] = mapped_column(Integer)
    num_survivors: Mapped[int] = mapped_column(Integer)
    participants: Mapped[list] = mapped_column(JSON)
    dropouts: Mapped[dict] = mapped_column(JSON)
    survivors: Mapped[list] = mapped_column(JSON)
    rejected: Mapped[dict] = mapped_column(JSON)
    excluded: Mapped[dict] = mapped_column(JSON)
    abort_reason: Mapped[str | None] = mapped_column(String)
    seconds: Mapped[dict] = mapped_column(JSON)
    security: Mapped[str] = mapped_column(String(16), server_default=SEMI_HONEST)
