"""Federated evaluation: each client's answer in an evaluation round.

``evaluations`` holds one row per client asked in a round: its fate (accepted, rejected
or dropped), the reason, its held-out example count and the global model's loss and
accuracy there, and its own model's where that differs (FedBN). Its rows go with their
round (ON DELETE CASCADE), like ``updates``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("client_id", sa.String(), nullable=False),
        sa.Column("fate", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("num_examples", sa.BigInteger(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("accuracy", sa.Float(), nullable=True),
        sa.Column("loss_personal", sa.Float(), nullable=True),
        sa.Column("accuracy_personal", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id", "round"], ["rounds.run_id", "rounds.round"],
                                name=op.f("fk_evaluations_run_id_round_rounds"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
    )
    op.create_index(op.f("ix_evaluations_run_id_round"), "evaluations", ["run_id", "round"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_evaluations_run_id_round"), table_name="evaluations")
    op.drop_table("evaluations")
