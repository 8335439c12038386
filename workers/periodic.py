"""Periodic upkeep: expiring batches, re-running shards whose worker died, deleting expired files.

Each runs on a timer (Celery beat, or the embedded queue's timers) and is safe to run anywhere,
any number of times at once.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import select, update

from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchStatus, File, Shard, ShardStatus
from pagedbatch.workers.context import WorkerContext

logger = logging.getLogger(__name__)


def expire_batches(ctx: WorkerContext) -> None:
    """Batches past their window: shards see it and stop; finalization ends them `expired`."""
    with ctx.session_factory() as session:
        due = session.scalars(
            select(Batch.id).where(
                Batch.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING]),
                Batch.expires_at <= now(),
            )
        ).all()
    for batch_id in due:
        ctx.queue.enqueue("finalize_batch", batch_id)


def reap_leases(ctx: WorkerContext) -> None:
    """Shards whose worker stopped renewing its lease go back to pending and run again,
    skipping the requests already recorded."""
    with transaction(ctx.session_factory) as session:
        lapsed = session.scalars(
            select(Shard.id).where(
                Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < time.time()
            )
        ).all()
        reclaimed = 0
        for shard_id in lapsed:
            reclaimed += session.execute(
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.status == ShardStatus.RUNNING,
                    Shard.lease_expires_at < time.time(),
                )
                .values(status=ShardStatus.PENDING, lease_owner=None, lease_expires_at=None)
            ).rowcount
    if reclaimed:
        logger.warning("re-queued %d shard(s) whose lease lapsed", reclaimed)
    for _ in range(reclaimed):
        ctx.queue.enqueue("run_shard")


def delete_expired_files(ctx: WorkerContext) -> None:
    with ctx.session_factory() as session:
        expired = session.execute(
            select(File.id, File.storage_key).where(File.expires_at <= now())
        ).all()
    for file_id, key in expired:
        ctx.blobs.delete(key)
        with transaction(ctx.session_factory) as session:
            session.execute(File.__table__.delete().where(File.id == file_id))
