"""Retention: deleting what the service no longer needs to keep, in bounded chunks.

A finished batch's requests (their bodies and results) go `batch_data_retention_days` after
it ended: by then its output and error files hold everything a client reads. Those files expire
`batch_output_retention_days` after they were written, unless their batch set an expiry of its
own: the expiry is written into their rows (so the File objects show it as `expires_at`), and
`delete_expired_files` deletes each, blob and row, once it is due. A finished batch itself goes
`batch_retention_days` after it ended (its requests first, in chunks; then the batch, with its
shards and webhook events). Webhook events
whose messages are all settled go after `webhook_retention_days`, with their messages and
delivery logs, as do older delivery attempts of messages still pending. Idempotency keys go after
`idempotency_key_retention_hours`, the usage ledger's records after `usage_retention_days`. A
setting of 0 keeps that data for good. Stored responses go once past the expiry they were saved
with (`response_retention_days` after they were created), rows and then their blobs.

Each run deletes at most MAX_CHUNKS chunks of CHUNK rows per kind, in a transaction each, so
neither a long lock nor a long run holds up the other upkeep jobs; the next run goes on.
"""

from __future__ import annotations

import logging

from sqlalchemy import ColumnElement, delete, func, select, tuple_, update

from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    TERMINAL,
    Batch,
    BatchRequest,
    File,
    IdempotencyKey,
    StoredResponse,
    UsageRecord,
    WebhookDelivery,
    WebhookEvent,
    WebhookMessage,
    WebhookMessageStatus,
)
from pagedbatch.store.responses import expired
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import prune_heartbeats

logger = logging.getLogger(__name__)

BATCH_OUTPUT = "batch_output"  # the purpose of a batch's output and error files
CHUNK = 1000
MAX_CHUNKS = 20  # per kind and run: 20,000 rows
DAY = 24 * 3600
HOUR = 3600


def apply_retention(ctx: WorkerContext) -> None:
    settings = ctx.settings
    if settings.batch_data_retention_days:
        cutoff = now() - settings.batch_data_retention_days * DAY
        ended = BatchRequest.batch_id.in_(select(Batch.id).where(_ended_before(cutoff)))
        _purge(ctx, "batch requests", [BatchRequest.id], ended)
    if settings.batch_output_retention_days:
        _expire_batch_outputs(ctx, round(settings.batch_output_retention_days * DAY))
    if settings.batch_retention_days:
        cutoff = now() - settings.batch_retention_days * DAY
        ended = select(Batch.id).where(_ended_before(cutoff))
        _purge(ctx, "purged batches' requests", [BatchRequest.id], BatchRequest.batch_id.in_(ended))
        # Only batches whose requests are gone: the cascade to them would be one unbounded delete.
        emptied = ~select(BatchRequest.id).where(BatchRequest.batch_id == Batch.id).exists()
        _purge(ctx, "batches", [Batch.id], _ended_before(cutoff) & emptied)
    if settings.webhook_retention_days:
        cutoff = now() - settings.webhook_retention_days * DAY
        pending = (
            select(WebhookMessage.id)
            .where(
                WebhookMessage.event_id == WebhookEvent.id,
                WebhookMessage.status == WebhookMessageStatus.PENDING,
            )
            .exists()
        )
        # Deleting an event deletes its messages and their deliveries (foreign-key cascades).
        settled = (WebhookEvent.created_at < cutoff) & ~pending
        _purge(ctx, "webhook events", [WebhookEvent.id], settled)
        old = WebhookDelivery.created_at < cutoff
        _purge(ctx, "webhook deliveries", [WebhookDelivery.id], old)
    if settings.idempotency_key_retention_hours:
        cutoff = now() - settings.idempotency_key_retention_hours * HOUR
        key = [IdempotencyKey.owner, IdempotencyKey.route, IdempotencyKey.key]
        _purge(ctx, "idempotency keys", key, IdempotencyKey.created_at < cutoff)
    if settings.usage_retention_days:
        cutoff = now() - settings.usage_retention_days * DAY
        _purge(ctx, "usage records", [UsageRecord.id], UsageRecord.finished_at < cutoff)
    # Stamped with their expiry when saved, as output files are: a retention set to 0 later
    # keeps the responses saved after, not those saved before.
    _purge(ctx, "stored responses", [StoredResponse.id], expired(), StoredResponse.blob_keys)
    prune_heartbeats(ctx)


def _ended_before(cutoff: float) -> ColumnElement[bool]:
    ended_at = func.coalesce(
        Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at
    )
    return Batch.status.in_([s.value for s in TERMINAL]) & (ended_at < cutoff)


def _expire_batch_outputs(ctx: WorkerContext, seconds: int) -> None:
    """Writes an expiry, `seconds` after they were written, into the batch output and error files
    that have none; a chunk per transaction."""
    unset = (File.purpose == BATCH_OUTPUT) & File.expires_at.is_(None)
    total = 0
    for _ in range(MAX_CHUNKS):
        chunk = select(File.id).where(unset).limit(CHUNK)
        with transaction(ctx.session_factory) as session:
            stamped = session.execute(
                update(File)
                .where(File.id.in_(chunk))
                .values(expires_at=File.created_at + seconds)
                .execution_options(synchronize_session=False)
            ).rowcount
        total += stamped
        if stamped < CHUNK:
            break
    if total:
        logger.info(
            "retention: %d batch output files will expire %d s after written", total, seconds
        )


def _purge(
    ctx: WorkerContext,
    what: str,
    key: list[ColumnElement],
    condition: ColumnElement,
    blob_keys: ColumnElement | None = None,
) -> None:
    """Delete the rows matching `condition` of the table whose primary key is `key`, a chunk
    per transaction; where rows name blobs (`blob_keys`: a JSON object whose values are keys),
    those blobs too, once the chunk's rows are gone, so that no row ever names a missing one."""
    table = key[0].table
    total = 0
    for _ in range(MAX_CHUNKS):
        chunk = select(*key).where(condition).limit(CHUNK)
        statement = delete(table).where(tuple_(*key).in_(chunk))
        named: list[str] = []
        with transaction(ctx.session_factory) as session:
            if blob_keys is None:
                deleted = session.execute(statement).rowcount
            else:
                returned = session.scalars(statement.returning(blob_keys)).all()
                deleted = len(returned)
                named = [blob for keys in returned if keys for blob in keys.values()]
        for blob in named:
            ctx.blobs.delete(blob)
        total += deleted
        if deleted < CHUNK:
            break
    if total:
        logger.info("retention: deleted %d %s", total, what)
