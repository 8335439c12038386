"""Picking work back up whatever was lost: tasks a crash or a broker restart dropped, or that a
process was running when it died.

Results already recorded are never redone (shards skip them), finalization and validation check
the batch's state first, and a `run_shard` or `run_response` task with nothing to claim
returns: so resuming more than needed is harmless; resuming less would strand a batch or a
background response.
"""

from __future__ import annotations

import time

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from pagedbatch.ids import now
from pagedbatch.store.models import Batch, BatchStatus, Shard, ShardStatus
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.responses import requeue_lost_responses


def resume_work(ctx: WorkerContext) -> None:
    """At a process's start: queue again whatever may have been lost while none ran."""
    with ctx.session_factory() as session:
        validating = validations_older_than(session, now() + 1)
    for batch_id in validating:
        ctx.queue.enqueue("validate_batch", batch_id)
    requeue_pending_shards(ctx)
    redrive_finalization(ctx)
    # The embedded server's queue kept its tasks in memory: every queued response's is lost.
    requeue_lost_responses(ctx, queued_before=time.time())


def requeue_pending_shards(ctx: WorkerContext) -> None:
    """Queue a `run_shard` for each pending shard that no queued task will pick up.

    Tasks are not bound to shards, so it is enough that the queue holds as many tasks as there
    are pending shards; counting every waiting task (not only shard runs) errs towards too few,
    and the next round tops up. A broker that restarted empty loses the rest.
    """
    with ctx.session_factory() as session:
        pending = session.scalar(
            select(func.count())
            .select_from(Shard)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == ShardStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS)
        )
    if not pending:
        return
    missing = pending - sum(ctx.queue.depths().values())
    for _ in range(missing):
        ctx.queue.enqueue("run_shard")


def redrive_finalization(ctx: WorkerContext) -> None:
    """Queue finalization of every batch that should be ending: finalizing or cancelling, or in
    progress with every shard done. Finalization is idempotent and claimed, so a batch being
    finalized right now is left to it."""
    with ctx.session_factory() as session:
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
    for batch_id in ending:
        ctx.queue.enqueue("finalize_batch", batch_id)


def redrive_validation(ctx: WorkerContext) -> None:
    """Queue validation again for batches validating longer than `validation_redrive_seconds`:
    their task was lost, or an outage outlasted its retries. Validation builds on what an earlier
    run left, so one queued beside a run still going is harmless (workers/batches/validation.py)."""
    cutoff = now() - ctx.settings.validation_redrive_seconds
    with ctx.session_factory() as session:
        stuck = validations_older_than(session, cutoff)
    for batch_id in stuck:
        ctx.queue.enqueue("validate_batch", batch_id)


def validations_older_than(session: Session, cutoff: float) -> list[str]:
    return list(
        session.scalars(
            select(Batch.id).where(
                Batch.status == BatchStatus.VALIDATING, Batch.created_at < cutoff
            )
        ).all()
    )
