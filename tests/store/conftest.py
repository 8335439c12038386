from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from services import postgres_schema
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.store.blobs import LocalBlobStore
from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.migrate import upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database of each kind: a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    with postgres_schema(request.getfixturevalue("postgres_url")) as url:
        yield url


@pytest.fixture
def sessions(empty_database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on each kind of empty database, migrated to the current schema."""
    upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def blobs(tmp_path: Path) -> LocalBlobStore:
    """A blob store in this test's directory."""
    return LocalBlobStore(tmp_path / "blobs")
