"""Webhook events: recorded with the batch transition that causes them, fanned out to endpoints.

An event and its messages are written in the transaction that ends the batch, so a batch that
ended always has them, whatever crashes afterwards; delivery picks them up from the job store.
"""

from __future__ import annotations

import time

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from pagedbatch.ids import new_id
from pagedbatch.store.models import (
    Batch,
    BatchStatus,
    WebhookEndpoint,
    WebhookEvent,
    WebhookMessage,
    WebhookMessageStatus,
)

EVENT_TYPES: dict[BatchStatus, str] = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.CANCELLED: "batch.cancelled",
    BatchStatus.EXPIRED: "batch.expired",
}


def record_batch_event(
    session: Session, batch_id: str, status: BatchStatus, created_at: int
) -> str:
    """Record that the batch reached `status` at `created_at` and queue a message to each of its
    owner's enabled endpoints that takes the event; returns the event's id."""
    owner = session.scalar(select(Batch.owner).where(Batch.id == batch_id))
    event = WebhookEvent(
        id=new_id("evt_"),
        owner=owner,
        type=EVENT_TYPES[status],
        batch_id=batch_id,
        created_at=created_at,
    )
    session.add(event)
    session.flush()  # the messages' foreign key needs the event row
    endpoints = session.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.owner == owner, WebhookEndpoint.disabled_at.is_(None)
        )
    ).all()
    due = time.time()
    messages = [
        {
            "id": new_id("wh_"),
            "event_id": event.id,
            "endpoint_id": endpoint.id,
            "status": WebhookMessageStatus.PENDING.value,
            "attempts": 0,
            "next_attempt_at": due,
        }
        for endpoint in endpoints
        if endpoint.events is None or event.type in endpoint.events
    ]
    if messages:
        session.execute(insert(WebhookMessage), messages)
    return event.id
