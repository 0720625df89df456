"""Privacy ledger: whom each epsilon protects against, and the released model's epsilon.

``protects_against`` names the adversary of ``epsilon`` ("server" or "released model");
``epsilon_model`` is the epsilon against the released model's consumers where it differs
(local and distributed DP). Rows written before this revision keep NULL in both.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.add_column(sa.Column("epsilon_model", sa.Float(), nullable=True))
        batch.add_column(sa.Column("protects_against", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.drop_column("protects_against")
        batch.drop_column("epsilon_model")
