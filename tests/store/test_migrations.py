"""The Alembic migrations build exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from pagedbatch.store.db import make_engine
from pagedbatch.store.migrate import alembic_config, upgrade
from pagedbatch.store.models import Base


def schema_differences(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def head(url: str) -> str:
    heads = ScriptDirectory.from_config(alembic_config(url)).get_heads()
    assert len(heads) == 1, f"the migrations have branched: heads {heads}"
    return heads[0]


def test_upgrade_builds_exactly_the_models_tables(empty_database_url: str) -> None:
    upgrade(empty_database_url)

    assert schema_differences(empty_database_url) == []
    assert current_revision(empty_database_url) == head(empty_database_url)


def test_upgrading_an_upgraded_database_changes_nothing(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    upgrade(empty_database_url)

    assert schema_differences(empty_database_url) == []
    assert current_revision(empty_database_url) == head(empty_database_url)


def test_downgrade_to_base_removes_every_table_and_upgrade_rebuilds_them(
    empty_database_url: str,
) -> None:
    upgrade(empty_database_url)

    command.downgrade(alembic_config(empty_database_url), "base")
    assert table_names(empty_database_url) == {"alembic_version"}

    upgrade(empty_database_url)
    assert schema_differences(empty_database_url) == []


@pytest.mark.parametrize("empty_database_url", ["postgresql"], indirect=True)
def test_processes_upgrading_postgresql_at_once_take_turns(empty_database_url: str) -> None:
    # Processes, as in a deployment: Alembic's context is global, so one process upgrades at a time.
    script = "import sys; from pagedbatch.store.migrate import upgrade; upgrade(sys.argv[1])"
    runs = [
        subprocess.Popen([sys.executable, "-c", script, empty_database_url], stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == 0, stderr.decode()

    assert schema_differences(empty_database_url) == []


def test_adding_response_events_keeps_the_webhook_messages_and_deliveries_of_batches(
    empty_database_url: str,
) -> None:
    # 0007 rebuilds webhook_events on SQLite, whose children's foreign keys cascade.
    command.upgrade(alembic_config(empty_database_url), "0006")
    engine = make_engine(empty_database_url)
    rows = [
        "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
        "created_at, request_total, request_completed, request_failed, input_tokens, "
        "cached_tokens, output_tokens) VALUES ('batch_1', 'default', '/v1/completions', "
        "'file-1', '24h', 'completed', 0, 0, 0, 0, 0, 0, 0)",
        "INSERT INTO webhook_endpoints (id, owner, url, secret, created_at) "
        "VALUES ('we_1', 'default', 'https://x', 's', 0)",
        "INSERT INTO webhook_events (id, owner, type, batch_id, created_at) "
        "VALUES ('evt_1', 'default', 'batch.completed', 'batch_1', 0)",
        "INSERT INTO webhook_messages (id, event_id, endpoint_id, status, attempts, "
        "next_attempt_at) VALUES ('wh_1', 'evt_1', 'we_1', 'pending', 1, 0)",
        "INSERT INTO webhook_deliveries (id, message_id, endpoint_id, attempt, outcome, "
        "created_at) VALUES ('whd_1', 'wh_1', 'we_1', 1, 'failed', 0)",
    ]
    try:
        with engine.begin() as conn:
            for row in rows:
                conn.exec_driver_sql(row)

        upgrade(empty_database_url)

        with engine.connect() as conn:
            kept = [
                conn.exec_driver_sql(f"SELECT id FROM {table}").scalars().all()
                for table in ("webhook_events", "webhook_messages", "webhook_deliveries")
            ]
    finally:
        engine.dispose()
    assert kept == [["evt_1"], ["wh_1"], ["whd_1"]]
    assert schema_differences(empty_database_url) == []
