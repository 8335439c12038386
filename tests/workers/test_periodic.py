"""Periodic upkeep on a real job store: expired files go, lapsed leases come back."""

from __future__ import annotations

import time

from sqlalchemy import select

from pagedbatch.ids import new_id, now
from pagedbatch.service import open_store
from pagedbatch.settings import Settings
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchStatus, File, Shard, ShardStatus
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.periodic import delete_expired_files, reap_leases


def make_context(tmp_path, ran: list) -> WorkerContext:
    settings = Settings(data_dir=tmp_path / "data")
    session_factory, blobs = open_store(settings)
    queue = InProcessQueue(lambda name, args: ran.append((name, args)))
    return WorkerContext(settings, session_factory, blobs, queue=queue)


def add_file(ctx: WorkerContext, expires_at: int | None) -> File:
    file = File(
        id=new_id("file-"),
        owner="default",
        filename="a.jsonl",
        purpose="batch",
        bytes=5,
        expires_at=expires_at,
        storage_key=f"files/{new_id('k')}",
    )
    ctx.blobs.put(file.storage_key, [b"hello"])
    with transaction(ctx.session_factory) as session:
        session.add(file)
    return file


def test_expired_files_lose_their_row_and_their_blob(tmp_path):
    ctx = make_context(tmp_path, [])
    old = add_file(ctx, expires_at=now() - 1)
    keep = add_file(ctx, expires_at=now() + 3600)
    forever = add_file(ctx, expires_at=None)
    delete_expired_files(ctx)
    with ctx.session_factory() as session:
        left = set(session.scalars(select(File.id)).all())
    assert left == {keep.id, forever.id}
    assert not ctx.blobs.exists(old.storage_key) and ctx.blobs.exists(keep.storage_key)


def test_a_lapsed_lease_puts_its_shard_back_and_queues_a_run(tmp_path):
    ran: list = []
    ctx = make_context(tmp_path, ran)
    with transaction(ctx.session_factory) as session:
        session.add(
            Batch(
                id="batch_x",
                owner="default",
                endpoint="/v1/completions",
                input_file_id="file-x",
                completion_window="24h",
                status=BatchStatus.IN_PROGRESS,
            )
        )
        session.flush()
        session.add_all(
            [
                Shard(
                    batch_id="batch_x",
                    owner="default",
                    index=0,
                    status=ShardStatus.RUNNING,
                    lease_owner="dead",
                    lease_expires_at=time.time() - 1,
                ),
                Shard(
                    batch_id="batch_x",
                    owner="default",
                    index=1,
                    status=ShardStatus.RUNNING,
                    lease_owner="alive",
                    lease_expires_at=time.time() + 60,
                ),
            ]
        )
    reap_leases(ctx)
    ctx.queue.shutdown()
    with ctx.session_factory() as session:
        states = dict(session.execute(select(Shard.index, Shard.status)).all())
    assert states == {0: ShardStatus.PENDING, 1: ShardStatus.RUNNING}
    assert ran == [("run_shard", ())]
