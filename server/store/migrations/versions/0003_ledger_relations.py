"""Privacy ledger: the neighbouring relation of every figure, and the replace-one figure.

``relation`` is ``epsilon``'s ("add/remove-one", "replace-one" or "zero-out"),
``relation_model`` ``epsilon_model``'s; ``epsilon_replace_one`` is the figure against the
same party as ``epsilon`` under replace-one, where ``relation`` is another. Rows written
before this revision keep NULL in all three (their relation was not recorded).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.add_column(sa.Column("relation", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("epsilon_replace_one", sa.Float(), nullable=True))
        batch.add_column(sa.Column("relation_model", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.drop_column("relation_model")
        batch.drop_column("epsilon_replace_one")
        batch.drop_column("relation")
