"""Periodic upkeep jobs: expiring batches, re-leasing shards whose worker died, deleting expired
files. workers/upkeep.py runs them (and those of recovery.py, retention.py and webhooks.py).

Each is safe to run anywhere, any number of times at once.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import or_, select, update

from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchStatus, File, Shard, ShardStatus
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import dead_workers, trusts_heartbeats

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
    """Shards whose worker died go back to pending and run again, skipping the requests already
    recorded: those whose worker's heartbeats stopped, and any whose lease lapsed."""
    abandoned = Shard.lease_expires_at < time.time()
    if trusts_heartbeats(ctx):
        abandoned = or_(abandoned, Shard.lease_owner.in_(dead_workers(ctx.settings)))
    with transaction(ctx.session_factory) as session:
        reclaimed = session.execute(
            update(Shard)
            .where(Shard.status == ShardStatus.RUNNING, abandoned)
            .values(status=ShardStatus.PENDING, lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        ).rowcount
    if reclaimed:
        logger.warning("re-queued %d shard(s) whose worker died", reclaimed)
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
