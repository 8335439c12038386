"""Idempotency keys remember what their request said, so that a key reused for another request
is refused (api/idempotency.py); keys stored before have none and match any request.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("fingerprint", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.drop_column("fingerprint")
