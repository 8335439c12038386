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
