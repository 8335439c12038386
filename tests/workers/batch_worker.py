"""A batch worker in the test process, driven step by step: its context on a real job store and
blob store (reached directly or through a TcpProxy), an engine on the tiny checkpoint, and a
queue that only records what the worker asks for, so that the test runs each task itself."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select

from pagedbatch.engine import AsyncLLM
from pagedbatch.ids import new_id, now
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import BlobStore
from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    File,
    Shard,
    ShardStatus,
)
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.workers.batches.finalize import finalize_batch
from pagedbatch.workers.batches.shards import run_shard
from pagedbatch.workers.batches.validation import validate_batch
from pagedbatch.workers.context import WorkerContext

CHAT = "/v1/chat/completions"
MODEL = "tiny"


@dataclass
class Worker:
    ctx: WorkerContext
    database: Engine
    queued: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def shutdown(self) -> None:
        self.ctx.queue.shutdown()
        self.database.dispose()


def make_worker(
    database_url: str, blobs: BlobStore, engine: AsyncLLM, tmp_path: Any, **settings: Any
) -> Worker:
    config = Settings(data_dir=tmp_path, database_url=database_url, **settings)
    database = make_engine(database_url)
    ctx = WorkerContext(config, make_session_factory(database), blobs, queue=None, engine=engine)
    worker = Worker(ctx, database)
    worker.ctx.queue = InProcessQueue(lambda name, args: worker.queued.append((name, args)))
    return worker


def chat_line(custom_id: str, **body: Any) -> dict[str, Any]:
    body.setdefault("messages", [{"role": "user", "content": f"Question {custom_id}?"}])
    body = {"model": MODEL, "max_tokens": 4, **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def submit(worker: Worker, lines: list[dict[str, Any]], owner: str = "default") -> str:
    """A validated batch of `lines`, in progress; its id."""
    ctx = worker.ctx
    key = f"files/{uuid.uuid4().hex}"
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    ctx.blobs.put(key, [data])
    file_id, batch_id = new_id("file-"), new_id("batch_")
    with transaction(ctx.session_factory) as session:
        session.add(
            File(
                id=file_id,
                owner=owner,
                filename="input.jsonl",
                purpose="batch",
                bytes=len(data),
                storage_key=key,
            )
        )
        session.add(
            Batch(
                id=batch_id,
                owner=owner,
                endpoint=CHAT,
                input_file_id=file_id,
                completion_window="24h",
                status=BatchStatus.VALIDATING,
                expires_at=now() + 3600,
            )
        )
    validate_batch(ctx, batch_id)
    assert batch(worker, batch_id).status == BatchStatus.IN_PROGRESS
    return batch_id


def batch(worker: Worker, batch_id: str) -> Batch:
    with worker.ctx.session_factory() as session:
        return session.get(Batch, batch_id)


def shard_states(worker: Worker, batch_id: str) -> list[str]:
    with worker.ctx.session_factory() as session:
        return list(
            session.scalars(
                select(Shard.status).where(Shard.batch_id == batch_id).order_by(Shard.index)
            )
        )


def pending_requests(worker: Worker, batch_id: str) -> int:
    with worker.ctx.session_factory() as session:
        return len(
            session.scalars(
                select(BatchRequest.id).where(
                    BatchRequest.batch_id == batch_id, BatchRequest.status == "pending"
                )
            ).all()
        )


def run_all_shards(worker: Worker, batch_id: str) -> None:
    while ShardStatus.PENDING in shard_states(worker, batch_id):
        run_shard(worker.ctx)


def finalized(worker: Worker, batch_id: str) -> tuple[Batch, dict[str, dict[str, Any]]]:
    """Finalize the batch; it and every line of its files, by custom_id (each seen once)."""
    finalize_batch(worker.ctx, batch_id)
    return batch(worker, batch_id), file_lines(worker, batch_id)


def file_lines(worker: Worker, batch_id: str) -> dict[str, dict[str, Any]]:
    ended = batch(worker, batch_id)
    lines: dict[str, dict[str, Any]] = {}
    with worker.ctx.session_factory() as session:
        for file_id in (ended.output_file_id, ended.error_file_id):
            if file_id is None:
                continue
            key = session.get(File, file_id).storage_key
            for raw in b"".join(worker.ctx.blobs.open(key)).splitlines():
                line = json.loads(raw)
                assert line["custom_id"] not in lines, f"{line['custom_id']} written twice"
                lines[line["custom_id"]] = line
    return lines
