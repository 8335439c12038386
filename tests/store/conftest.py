from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from services import postgres_schema


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database of each kind: a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    with postgres_schema(request.getfixturevalue("postgres_url")) as url:
        yield url
