"""Usage records say which of OpenAI's usage endpoints counts them (`kind`): `completions` (chat,
completions, responses, transcriptions) or `embeddings`; records written before are completions.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "usage_records",
        sa.Column("kind", sa.String(16), nullable=False, server_default="completions"),
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("kind")
