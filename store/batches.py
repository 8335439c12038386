"""The batch state machine, and the counters the API reports while a batch runs.

Transitions are compare-and-set updates (`UPDATE ... WHERE status IN (allowed sources)`), so two
processes racing (a cancel against the last shard finishing, say) cannot both win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from pagedbatch.ids import new_id, now
from pagedbatch.store.models import (
    TERMINAL,
    Batch,
    BatchRequest,
    BatchStatus,
    RequestStatus,
    Shard,
    ShardStatus,
    UsageRecord,
)
from pagedbatch.store.usage import Usage, usage_kind
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


@dataclass(frozen=True)
class LineResult:
    """One request's outcome: its output or error line, and the tokens it used."""

    request_id: int
    status: RequestStatus
    result: dict
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0


def holds_lease(session: Session, shard_id: int, worker_id: str) -> bool:
    """Whether `worker_id` holds the shard's lease; if so, its row stays locked until the
    transaction ends, so the reaper cannot hand the shard to another worker before what this
    transaction writes under the lease is committed."""
    held = session.scalar(
        select(Shard.id)
        .where(Shard.id == shard_id, Shard.lease_owner == worker_id)
        .with_for_update()
    )
    return held is not None


def record_results(
    session: Session, batch_id: str, results: Sequence[LineResult]
) -> list[LineResult]:
    """Persist requests' outcomes and count them on the batch row, each exactly once; returns
    those written.

    Only requests still pending are written (locked first, so no other writer changes them
    before the commit) and only those are counted: a retried write, a replayed shard's, or one
    racing finalization's closing of a stopped batch writes and counts nothing twice. The batch
    row is updated once, however many results there are; the usage ledger gets a record per
    line that ran a model, in the same transaction.
    """
    pending = set(
        session.scalars(
            select(BatchRequest.id)
            .where(
                BatchRequest.id.in_([r.request_id for r in results]),
                BatchRequest.status == RequestStatus.PENDING,
            )
            .with_for_update()
        )
    )
    written = [r for r in results if r.request_id in pending]
    if not written:
        return []
    finished_at = now()
    session.execute(
        update(BatchRequest),
        [
            {
                "id": r.request_id,
                "status": r.status.value,
                "result": r.result,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "finished_at": finished_at,
            }
            for r in written
        ],
    )
    succeeded = sum(r.status == RequestStatus.SUCCEEDED for r in written)
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            request_completed=Batch.request_completed + succeeded,
            request_failed=Batch.request_failed + len(written) - succeeded,
            input_tokens=Batch.input_tokens + sum(r.prompt_tokens for r in written),
            cached_tokens=Batch.cached_tokens + sum(r.cached_tokens for r in written),
            output_tokens=Batch.output_tokens + sum(r.completion_tokens for r in written),
        )
    )
    _record_usage(session, batch_id, written, finished_at)
    return written


def _record_usage(
    session: Session, batch_id: str, written: Sequence[LineResult], finished_at: int
) -> None:
    """The usage ledger's records of the lines that ran a model, with their results (so a line
    is counted exactly when its result is written, once)."""
    ran = [r for r in written if r.prompt_tokens or r.completion_tokens]
    if not ran:
        return
    owner, model, endpoint = session.execute(
        select(Batch.owner, Batch.model, Batch.endpoint).where(Batch.id == batch_id)
    ).one()
    records = [
        Usage(
            owner=owner,
            model=model,
            batch_id=batch_id,
            kind=usage_kind(endpoint),
            input_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            output_tokens=r.completion_tokens,
            image_tokens=r.image_tokens,
            audio_tokens=r.audio_tokens,
        )
        for r in ran
    ]
    session.execute(
        insert(UsageRecord), [{**asdict(u), "finished_at": finished_at} for u in records]
    )


def fail_pending(session: Session, batch_id: str, shard_index: int, error: dict[str, str]) -> int:
    """Record every pending request of one shard as failed, its error-file line carrying `error`
    (`code` and `message`); returns how many were."""
    pending = session.execute(
        select(BatchRequest.id, BatchRequest.custom_id).where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.shard_index == shard_index,
            BatchRequest.status == RequestStatus.PENDING,
        )
    ).all()
    results = [
        LineResult(
            request_id,
            RequestStatus.FAILED,
            {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error},
        )
        for request_id, custom_id in pending
    ]
    return len(record_results(session, batch_id, results))


def unfinished_shards(session: Session, batch_id: str) -> int:
    return session.scalar(
        select(func.count())
        .select_from(Shard)
        .where(Shard.batch_id == batch_id, Shard.status != ShardStatus.DONE)
    )
