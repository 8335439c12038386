"""The batch state machine, and the counters the API reports while a batch runs.

Transitions are compare-and-set updates (`UPDATE ... WHERE status IN (allowed sources)`), so two
processes racing (a cancel against the last shard finishing, say) cannot both win.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, load_only

from pagedbatch.ids import new_id, now
from pagedbatch.store.models import (
    TERMINAL,
    Batch,
    BatchRequest,
    BatchStatus,
    RequestStatus,
    Shard,
    ShardStatus,
)
from pagedbatch.store.webhooks import record_batch_event

S = BatchStatus

# target -> the states it may be entered from
SOURCES: dict[BatchStatus, set[BatchStatus]] = {
    S.FAILED: {S.VALIDATING},
    S.IN_PROGRESS: {S.VALIDATING},
    S.FINALIZING: {S.IN_PROGRESS},
    S.COMPLETED: {S.FINALIZING},
    S.EXPIRED: {S.VALIDATING, S.IN_PROGRESS, S.FINALIZING},
    S.CANCELLING: {S.VALIDATING, S.IN_PROGRESS, S.FINALIZING},
    S.CANCELLED: {S.CANCELLING},
}

TIMESTAMP = {
    S.FAILED: "failed_at",
    S.IN_PROGRESS: "in_progress_at",
    S.FINALIZING: "finalizing_at",
    S.COMPLETED: "completed_at",
    S.EXPIRED: "expired_at",
    S.CANCELLING: "cancelling_at",
    S.CANCELLED: "cancelled_at",
}


def transition(session: Session, batch_id: str, target: BatchStatus, **values: object) -> bool:
    """Move the batch to `target` if its current state allows it; False if it did not.

    Entering a final state records its webhook event in the same transaction."""
    moment = values[TIMESTAMP[target]] = now()
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_([s.value for s in SOURCES[target]]))
        .values(status=target.value, **values)
    )
    moved = result.rowcount == 1
    if moved and target in TERMINAL:
        record_batch_event(session, batch_id, target, created_at=moment)
    return moved


def stopping(batch: Batch) -> bool:
    """Whether the batch's unfinished requests should stop: cancelled or past its window."""
    return batch.status == S.CANCELLING or (
        batch.expires_at is not None and now() >= batch.expires_at
    )


def record_result(
    session: Session,
    request: BatchRequest,
    status: RequestStatus,
    result: dict,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    completion_tokens: int = 0,
) -> bool:
    """Persist one request's outcome and count it, exactly once (a retried shard may try again)."""
    written = session.execute(
        update(BatchRequest)
        .where(BatchRequest.id == request.id, BatchRequest.status == RequestStatus.PENDING)
        .values(
            status=status.value,
            result=result,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            finished_at=now(),
        )
    )
    if written.rowcount != 1:
        return False
    succeeded = status == RequestStatus.SUCCEEDED
    session.execute(
        update(Batch)
        .where(Batch.id == request.batch_id)
        .values(
            request_completed=Batch.request_completed + int(succeeded),
            request_failed=Batch.request_failed + int(not succeeded),
            input_tokens=Batch.input_tokens + prompt_tokens,
            cached_tokens=Batch.cached_tokens + cached_tokens,
            output_tokens=Batch.output_tokens + completion_tokens,
        )
    )
    return True


def fail_pending(session: Session, batch_id: str, shard_index: int, error: dict[str, str]) -> int:
    """Record every pending request of one shard as failed, its error-file line carrying `error`
    (`code` and `message`); returns how many were."""
    pending = session.scalars(
        select(BatchRequest)
        .options(load_only(BatchRequest.id, BatchRequest.batch_id, BatchRequest.custom_id))
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.shard_index == shard_index,
            BatchRequest.status == RequestStatus.PENDING,
        )
    ).all()
    failed = 0
    for request in pending:
        line = {
            "id": new_id("batch_req_"),
            "custom_id": request.custom_id,
            "response": None,
            "error": error,
        }
        failed += record_result(session, request, RequestStatus.FAILED, line)
    return failed


def unfinished_shards(session: Session, batch_id: str) -> int:
    return session.scalar(
        select(func.count())
        .select_from(Shard)
        .where(Shard.batch_id == batch_id, Shard.status != ShardStatus.DONE)
    )
