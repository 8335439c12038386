"""Fixtures for the real services tests run against: PostgreSQL and an S3 server.

`from services import *` in a conftest.py makes them available. Nothing here is faked, and
nothing skips: a service that cannot be reached fails the tests that need it. How a database is
made and a SeaweedFS server started is benchmarks/harness.py's, which the benchmarks use too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from harness import S3Server, SeaweedFS, postgres_database, redis_database
from sqlalchemy import make_url, text

from pagedbatch.store.db import make_engine

__all__ = [
    "S3Server",
    "SeaweedFS",
    "postgres_schema",
    "postgres_url",
    "redis_url",
    "s3_server",
    "s3_settings_env",
]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a new, empty PostgreSQL database, dropped after the session."""
    with postgres_database("pagedbatch_test") as database:
        yield database.url


@contextmanager
def postgres_schema(database_url: str) -> Iterator[str]:
    """A new, empty schema in the database, as the search path of the URL yielded; then dropped.

    Tables, indexes and Alembic's version table made through that URL all land in the schema, so
    tests sharing `postgres_url` stay apart.
    """
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(database_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            # A connection left open in a transaction would block the drop: fail, do not hang.
            conn.execute(text("SET LOCAL lock_timeout = '30s'"))
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database of the test's own on the local server (a broker, its keys), emptied
    before and after."""
    with redis_database() as url:
        yield url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS `weed mini` S3 server on loopback, its data in a temporary directory."""
    weed = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    weed.start()
    try:
        yield weed.server
    finally:
        weed.stop()


@pytest.fixture
def s3_settings_env(monkeypatch: pytest.MonkeyPatch, s3_server: S3Server) -> str:
    """A fresh bucket name, with the environment pointing boto3 and `Settings()` at the server.

    Sets boto3's `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, and
    `PAGEDBATCH_S3_ENDPOINT_URL`, `PAGEDBATCH_S3_BUCKET` (this bucket). The bucket does not exist
    yet: `S3BlobStore` makes it.
    """
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    for name, value in {**s3_server.env(), "PAGEDBATCH_S3_BUCKET": bucket}.items():
        monkeypatch.setenv(name, value)
    return bucket
