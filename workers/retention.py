"""Retention: deleting what the service no longer needs to keep, in bounded chunks.

A finished batch's requests (their bodies and results) go `batch_data_retention_days` after
it ended: by then its output and error files hold everything a client reads. Webhook events
whose messages are all settled go after `webhook_retention_days`, with their messages and
delivery logs, as do older delivery attempts of messages still pending. Idempotency keys go after
`idempotency_key_retention_hours`, the usage ledger's records after `usage_retention_days`. A
setting of 0 keeps that data for good.

Each run deletes at most MAX_CHUNKS chunks of CHUNK rows per kind, in a transaction each, so
neither a long lock nor a long run holds up the other upkeep jobs; the next run goes on.
"""

from __future__ import annotations

import logging

from sqlalchemy import ColumnElement, Select, delete, func, select, tuple_

from pagedbatch.ids import now
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    TERMINAL,
    Batch,
    BatchRequest,
    IdempotencyKey,
    UsageRecord,
    WebhookDelivery,
    WebhookEvent,
    WebhookMessage,
    WebhookMessageStatus,
)
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import prune_heartbeats

logger = logging.getLogger(__name__)

CHUNK = 1000
MAX_CHUNKS = 20  # per kind and run: 20,000 rows
DAY = 24 * 3600
HOUR = 3600


def apply_retention(ctx: WorkerContext) -> None:
    settings = ctx.settings
    if settings.batch_data_retention_days:
        cutoff = now() - settings.batch_data_retention_days * DAY
        ended = BatchRequest.batch_id.in_(_ended_before(cutoff))
        _purge(ctx, "batch requests", [BatchRequest.id], ended)
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
    prune_heartbeats(ctx)


def _ended_before(cutoff: float) -> Select[tuple[str]]:
    ended_at = func.coalesce(
        Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at
    )
    return select(Batch.id).where(Batch.status.in_([s.value for s in TERMINAL]), ended_at < cutoff)


def _purge(
    ctx: WorkerContext, what: str, key: list[ColumnElement], condition: ColumnElement
) -> None:
    """Delete the rows matching `condition` of the table whose primary key is `key`, a chunk
    per transaction."""
    table = key[0].table
    total = 0
    for _ in range(MAX_CHUNKS):
        chunk = select(*key).where(condition).limit(CHUNK)
        with transaction(ctx.session_factory) as session:
            deleted = session.execute(delete(table).where(tuple_(*key).in_(chunk))).rowcount
        total += deleted
        if deleted < CHUNK:
            break
    if total:
        logger.info("retention: deleted %d %s", total, what)
