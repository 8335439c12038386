from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from batch_worker import Worker, make_worker
from services import postgres_schema
from sqlalchemy import make_url

from pagedbatch.engine import AsyncLLM
from pagedbatch.store.blobs import BlobStore, LocalBlobStore
from pagedbatch.store.migrate import upgrade


@pytest.fixture(scope="module")
def async_engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_llama), served_model_name="tiny", num_kv_blocks=256)
    yield llm
    llm.shutdown()


@pytest.fixture
def worker_database_url(postgres_url: str) -> Iterator[str]:
    """A migrated PostgreSQL schema of this test's own."""
    with postgres_schema(postgres_url) as url:
        upgrade(url)
        yield url


MakeWorker = Callable[..., Worker]


@pytest.fixture
def make_batch_worker(
    worker_database_url: str, async_engine: AsyncLLM, tmp_path: Path
) -> Iterator[MakeWorker]:
    """`make_batch_worker(database_port=None, blobs=None, **settings)`: a worker on this test's
    schema, through `database_port` (a proxy's) when given, and on `blobs` (default: a local
    directory)."""
    workers: list[Worker] = []

    def make(
        database_port: int | None = None, blobs: BlobStore | None = None, **settings: Any
    ) -> Worker:
        url = worker_database_url
        if database_port is not None:
            url = make_url(url).set(port=database_port).render_as_string(hide_password=False)
        worker = make_worker(
            url, blobs or LocalBlobStore(tmp_path / "blobs"), async_engine, tmp_path, **settings
        )
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.shutdown()
