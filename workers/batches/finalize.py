"""Ending a batch: writing its output and error files and entering its final state.

Every input line ends in exactly one of the two files. A finished request is written as it was
recorded; one that never ran gets `batch_cancelled` or `batch_expired`. Files are streamed from
the database to storage, never held whole. Finalization is idempotent: file ids and storage keys
derive from the batch id, so a retry after a crash or an outage rewrites the same files, and the
batch records them only as it enters its final state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from pagedbatch.ids import new_id, now
from pagedbatch.store.batches import stopping, transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    TERMINAL,
    Batch,
    BatchRequest,
    BatchStatus,
    File,
    RequestStatus,
    Shard,
    ShardStatus,
)
from pagedbatch.store.retry import is_transient, retrying
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.retention import DAY
from pagedbatch.workers.webhooks import queue_batch_webhooks

logger = logging.getLogger(__name__)

STALE_FINALIZATION_SECONDS = 300  # a finalization that has not ended by then is taken over
READ_CHUNK = 1000

NEVER_RAN = {
    RequestStatus.CANCELLED: {
        "code": "batch_cancelled",
        "message": "This request was not executed because the batch was cancelled.",
    },
    RequestStatus.EXPIRED: {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    },
}


def finalize_batch(ctx: WorkerContext, batch_id: str) -> None:
    """Write the batch's files and end it. Database and storage outages are ridden out; should
    one last too long, the batch stays where it was (finalizing, cancelling, or in_progress past
    its window) with no file recorded, and upkeep drives its finalization again."""
    if not retrying(lambda: _ready(ctx, batch_id), f"looking at batch {batch_id}"):
        return
    claimed_at = retrying(lambda: _claim(ctx, batch_id), f"claiming batch {batch_id}")
    if claimed_at is None:
        return
    try:
        leftover = retrying(lambda: _close(ctx, batch_id), f"closing batch {batch_id}")
        output_id, error_id = _write_files(ctx, batch_id)
        retrying(
            lambda: _end(ctx, batch_id, leftover, output_id, error_id),
            f"ending batch {batch_id}",
        )
    except BaseException:
        _release(ctx, batch_id, claimed_at)
        raise
    try:
        queue_batch_webhooks(ctx, batch_id)
    except Exception as e:
        if not is_transient(e):
            raise
        logger.warning("batch %s: webhooks left to the sweep (%s)", batch_id, e)
    logger.info("batch %s finalized", batch_id)


def _ready(ctx: WorkerContext, batch_id: str) -> bool:
    with ctx.session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status in TERMINAL:
            return False
        if _shards_still_running(session, batch_id):
            return False  # the last one to stop enqueues finalization again
        # Validation ends in failure, in_progress or (cancelled) a new finalization.
        return batch.status != BatchStatus.VALIDATING


def _close(ctx: WorkerContext, batch_id: str) -> RequestStatus | None:
    """Close the requests that never ran; returns what they became (None: every one ran)."""
    with transaction(ctx.session_factory) as session:
        batch = session.get(Batch, batch_id)
        leftover = _leftover_status(session, batch)
        if leftover is not None:
            _close_pending(session, batch_id, leftover)
        if batch.status == BatchStatus.IN_PROGRESS and leftover is None:
            transition(session, batch_id, BatchStatus.FINALIZING)
        return leftover


def _end(
    ctx: WorkerContext,
    batch_id: str,
    leftover: RequestStatus | None,
    output_id: str | None,
    error_id: str | None,
) -> None:
    with transaction(ctx.session_factory) as session:
        files = {"output_file_id": output_id, "error_file_id": error_id}
        batch = session.get(Batch, batch_id)
        if batch.status == BatchStatus.CANCELLING:
            target = BatchStatus.CANCELLED
        elif leftover == RequestStatus.EXPIRED:
            target = BatchStatus.EXPIRED
        else:
            target = BatchStatus.COMPLETED
        if not transition(session, batch_id, target, **files):
            # Cancelled while the files were written: they hold every result, so keep them.
            transition(session, batch_id, BatchStatus.CANCELLED, **files)


def _shards_still_running(session: Session, batch_id: str) -> bool:
    live = session.scalar(
        select(Shard.id)
        .where(
            Shard.batch_id == batch_id,
            Shard.status == ShardStatus.RUNNING,
            Shard.lease_expires_at > time.time(),
        )
        .limit(1)
    )
    return live is not None


def _claim(ctx: WorkerContext, batch_id: str) -> int | None:
    """One finalization at a time; a stale one (its process died) is taken over. Returns the
    claim's time, None if another finalization holds it."""
    moment = now()
    with transaction(ctx.session_factory) as session:
        claimed = session.execute(
            update(Batch)
            .where(
                Batch.id == batch_id,
                Batch.status.not_in([s.value for s in TERMINAL]),
                or_(
                    Batch.finalize_claimed_at.is_(None),
                    Batch.finalize_claimed_at < moment - STALE_FINALIZATION_SECONDS,
                ),
            )
            .values(finalize_claimed_at=moment)
        )
        return moment if claimed.rowcount == 1 else None


def _release(ctx: WorkerContext, batch_id: str, claimed_at: int) -> None:
    """Give up a failed finalization's claim, so that the next try need not wait for it to go
    stale; if the database is what failed, the claim goes stale instead."""
    try:
        with transaction(ctx.session_factory) as session:
            session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.finalize_claimed_at == claimed_at)
                .values(finalize_claimed_at=None)
            )
    except Exception:  # noqa: BLE001 - the failure being raised is the one to report
        logger.warning("could not release the finalization claim of %s", batch_id, exc_info=True)


def _leftover_status(session: Session, batch: Batch) -> RequestStatus | None:
    """What the requests that never ran become; None when every request has finished."""
    if batch.status == BatchStatus.CANCELLING:
        return RequestStatus.CANCELLED
    pending = session.scalar(
        select(BatchRequest.id)
        .where(BatchRequest.batch_id == batch.id, BatchRequest.status == RequestStatus.PENDING)
        .limit(1)
    )
    if pending is None:
        return None
    if stopping(batch):
        return RequestStatus.EXPIRED
    # Shards only leave requests pending when told to stop; anything else is a bug to see.
    raise RuntimeError(f"batch {batch.id} has pending requests and no running shard")


def _close_pending(session: Session, batch_id: str, status: RequestStatus) -> None:
    closed = session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.status == RequestStatus.PENDING)
        .values(status=status.value, finished_at=now())
    )
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(request_failed=Batch.request_failed + closed.rowcount)
    )


def _file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


def _write_files(ctx: WorkerContext, batch_id: str) -> tuple[str | None, str | None]:
    """Write the output and error files; returns their ids (None where a file has no line)."""
    output_id = retrying(
        lambda: _write_file(ctx, batch_id, "output", [RequestStatus.SUCCEEDED]),
        f"writing the output file of {batch_id}",
    )
    error_id = retrying(
        lambda: _write_file(
            ctx,
            batch_id,
            "error",
            [RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED],
        ),
        f"writing the error file of {batch_id}",
    )
    return output_id, error_id


def _write_file(
    ctx: WorkerContext, batch_id: str, kind: str, statuses: list[RequestStatus]
) -> str | None:
    """Write one file whole, from the start: safe to retry, as a `put` that fails leaves nothing
    and the file's id and key derive from the batch."""
    key = f"batches/{batch_id}/{kind}.jsonl"
    counter = {"lines": 0}
    size = ctx.blobs.put(key, _lines(ctx, batch_id, statuses, counter))
    if counter["lines"] == 0:
        ctx.blobs.delete(key)
        return None
    file_id = _file_id(batch_id, kind)
    with transaction(ctx.session_factory) as session:
        batch = session.get(Batch, batch_id)
        created = now()
        # The batch's own expiry, else the service's retention (upkeep stamps files written
        # before that was set); none when outputs are kept for good.
        expires = batch.output_expires_after_seconds or round(
            ctx.settings.batch_output_retention_days * DAY
        )
        session.merge(
            File(
                id=file_id,
                owner=batch.owner,
                filename=f"{batch_id}_{kind}.jsonl",
                purpose="batch_output",
                bytes=size,
                created_at=created,
                expires_at=created + expires if expires else None,
                status="processed",
                storage_key=key,
            )
        )
    return file_id


def _lines(
    ctx: WorkerContext, batch_id: str, statuses: list[RequestStatus], counter: dict[str, int]
) -> Iterator[bytes]:
    with ctx.session_factory() as session:
        rows = session.execute(
            select(BatchRequest.custom_id, BatchRequest.status, BatchRequest.result)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.status.in_([s.value for s in statuses]),
            )
            .order_by(BatchRequest.line)
            .execution_options(yield_per=READ_CHUNK)
        )
        for custom_id, status, result in rows:
            if result is None:  # never ran
                result = {
                    "id": new_id("batch_req_"),
                    "custom_id": custom_id,
                    "response": None,
                    "error": NEVER_RAN[RequestStatus(status)],
                }
            counter["lines"] += 1
            yield json.dumps(result, separators=(",", ":")).encode() + b"\n"
