"""The usage ledger (one record per finished request, realtime or batch line) and the service's
spend limit (store/usage.py).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("image_tokens", sa.Integer(), nullable=False),
        sa.Column("audio_tokens", sa.Integer(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_usage_records_time", "usage_records", ["finished_at"])
    op.create_table(
        "spend_limits",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("threshold_cents", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(8), nullable=False),
        sa.Column("interval", sa.String(16), nullable=False),
        sa.Column("notification_channel", sa.JSON(), nullable=True),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("spend_limits")
    op.drop_index("ix_usage_records_time", "usage_records")
    op.drop_table("usage_records")
