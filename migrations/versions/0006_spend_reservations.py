"""Spend budgets and reservations: each request's worst case is reserved against its key's and
the service's monthly budget before it runs, and settled when it ends (store/reservations.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "spend_budgets",
        sa.Column("scope", sa.String(80), nullable=False),
        sa.Column("month", sa.BigInteger(), nullable=False),
        sa.Column("spent_nanos", sa.BigInteger(), nullable=False),
        sa.Column("reserved_nanos", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "month"),
    )
    op.create_table(
        "spend_reservations",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("month", sa.BigInteger(), nullable=False),
        sa.Column("nanos", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_spend_reservations_expiry", "spend_reservations", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_spend_reservations_expiry", "spend_reservations")
    op.drop_table("spend_reservations")
    op.drop_table("spend_budgets")
