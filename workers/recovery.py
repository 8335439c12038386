"""Picking work back up when a process starts: whatever a crash left queued or half done.

Results already recorded are never redone (shards skip them), so resuming more than needed is
harmless; resuming less would strand a batch.
"""

from __future__ import annotations

from sqlalchemy import and_, func, or_, select

from pagedbatch.store.models import Batch, BatchStatus, Shard, ShardStatus
from pagedbatch.workers.context import WorkerContext


def resume_work(ctx: WorkerContext) -> None:
    with ctx.session_factory() as session:
        validating = session.scalars(
            select(Batch.id).where(Batch.status == BatchStatus.VALIDATING)
        ).all()
        num_pending = session.scalar(
            select(func.count())
            .select_from(Shard)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == ShardStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS)
        )
        unfinished_shard = (
            select(Shard.id)
            .where(Shard.batch_id == Batch.id, Shard.status != ShardStatus.DONE)
            .exists()
        )
        ending = session.scalars(
            select(Batch.id).where(
                or_(
                    Batch.status.in_([BatchStatus.CANCELLING, BatchStatus.FINALIZING]),
                    and_(Batch.status == BatchStatus.IN_PROGRESS, ~unfinished_shard),
                )
            )
        ).all()
    for batch_id in validating:
        ctx.queue.enqueue("validate_batch", batch_id)
    for _ in range(num_pending):
        ctx.queue.enqueue("run_shard")
    for batch_id in ending:
        ctx.queue.enqueue("finalize_batch", batch_id)
