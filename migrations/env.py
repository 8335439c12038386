"""Alembic's entry point, driven by `pagedbatch.store.migrate` (there is no alembic.ini).

The database URL arrives in `config.attributes`, not the ini-style main options, so a password
holding `%` survives configparser's interpolation.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from pagedbatch.store.db import make_engine
from pagedbatch.store.migrate import DATABASE_URL_ATTRIBUTE
from pagedbatch.store.models import Base

# Any constant shared by every migrator; pg_advisory_xact_lock takes a bigint.
_UPGRADE_LOCK_ID = 0x7061676564  # "paged"


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # API replicas and workers may all upgrade at start: the lock makes the losers wait,
            # then find the schema at head and do nothing. PostgreSQL runs the whole upgrade in
            # this one transaction, so the lock is held until it commits.
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _UPGRADE_LOCK_ID})
        context.run_migrations()


def _run_online() -> None:
    engine = make_engine(context.config.attributes[DATABASE_URL_ATTRIBUTE])
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


_run_online()
