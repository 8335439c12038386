"""Background responses' runs (workers/responses.py): the lease of the worker running one, how
many times one was claimed, and when its task was last queued.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMNs: on SQLite a rebuild of the table would cascade to its webhook events.
    op.add_column("responses", sa.Column("lease_owner", sa.String(128), nullable=True))
    op.add_column("responses", sa.Column("lease_expires_at", sa.Float(), nullable=True))
    op.add_column(
        "responses", sa.Column("attempts", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("responses", sa.Column("queued_at", sa.Float(), nullable=True))
    op.create_index("ix_responses_status", "responses", ["status"])


def downgrade() -> None:
    op.drop_index("ix_responses_status", "responses")
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("queued_at")
        batch.drop_column("attempts")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
