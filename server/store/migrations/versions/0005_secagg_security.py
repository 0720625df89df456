"""Secure rounds: which threat model each session held against.

``secagg_rounds.security`` is "semi_honest" (an honest-but-curious server) or "malicious"
(signed key advertisements, a derived graph and a consistency check: a server that lies).
Rows written before this revision were all semi-honest sessions and read so.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("secagg_rounds") as batch:
        batch.add_column(sa.Column("security", sa.String(length=16), nullable=False,
                                   server_default="semi_honest"))


def downgrade() -> None:
    with op.batch_alter_table("secagg_rounds") as batch:
        batch.drop_column("security")
