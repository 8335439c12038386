"""Stored responses (store/responses.py), and webhook events of background responses: an event
names a batch or a response.

On SQLite, changing webhook_events rebuilds the table, and dropping the old one would delete the
messages and delivery attempts that reference it (their foreign keys cascade, and the embedded
server turns foreign keys on); they are kept aside and put back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op
from alembic.operations import BatchOperations

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The tables whose rows a rebuild of webhook_events would cascade to, parents first.
_EVENT_CHILDREN = ("webhook_messages", "webhook_deliveries")


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("request", sa.JSON(), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("blob_keys", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("completed_at", sa.BigInteger(), nullable=True),
        sa.Column("expires_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_responses_owner", "responses", ["owner"])
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])

    def add_response_subject(batch: BatchOperations) -> None:
        batch.alter_column("batch_id", existing_type=sa.String(64), nullable=True)
        batch.add_column(sa.Column("response_id", sa.String(64), nullable=True))
        batch.create_unique_constraint("uq_webhook_events_response_id", ["response_id"])
        batch.create_foreign_key(
            "fk_webhook_events_response_id",
            "responses",
            ["response_id"],
            ["id"],
            ondelete="CASCADE",
        )
        batch.create_check_constraint("one_subject", "(batch_id IS NULL) <> (response_id IS NULL)")

    _alter_events(add_response_subject)


def downgrade() -> None:
    op.execute("DELETE FROM webhook_events WHERE response_id IS NOT NULL")

    def drop_response_subject(batch: BatchOperations) -> None:
        batch.drop_constraint("one_subject", type_="check")
        batch.drop_constraint("fk_webhook_events_response_id", type_="foreignkey")
        batch.drop_constraint("uq_webhook_events_response_id", type_="unique")
        batch.drop_column("response_id")
        batch.alter_column("batch_id", existing_type=sa.String(64), nullable=False)

    _alter_events(drop_response_subject)
    op.drop_index("ix_responses_expires_at", "responses")
    op.drop_index("ix_responses_owner", "responses")
    op.drop_table("responses")


def _alter_events(alter: Callable[[BatchOperations], None]) -> None:
    """`alter` applied to webhook_events, its children's rows surviving a SQLite rebuild."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        for table in _EVENT_CHILDREN:
            op.execute(f"CREATE TEMP TABLE kept_{table} AS SELECT * FROM {table}")
    with op.batch_alter_table("webhook_events") as batch:
        alter(batch)
    if sqlite:
        for table in _EVENT_CHILDREN:
            # Only the rows the rebuild deleted: with foreign keys off, it deleted none.
            op.execute(
                f"INSERT INTO {table} SELECT * FROM kept_{table} "
                f"WHERE id NOT IN (SELECT id FROM {table})"
            )
            op.execute(f"DROP TABLE kept_{table}")
