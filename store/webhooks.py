"""Webhook events: recorded with the batch or background response transition that causes them,
fanned out to endpoints.

An event and its messages are written in the transaction that ends the batch (or the response),
so one that ended always has them, whatever crashes afterwards; delivery picks them up from the
job store.
"""

from __future__ import annotations

import time

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from pagedbatch.ids import new_id
from pagedbatch.store.models import (
    Batch,
    BatchStatus,
    ResponseStatus,
    StoredResponse,
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


RESPONSE_EVENT_TYPES: dict[ResponseStatus, str] = {
    ResponseStatus.COMPLETED: "response.completed",
    ResponseStatus.FAILED: "response.failed",
    ResponseStatus.CANCELLED: "response.cancelled",
    ResponseStatus.INCOMPLETE: "response.incomplete",
}


def record_batch_event(
    session: Session, batch_id: str, status: BatchStatus, created_at: int
) -> str:
    """Record that the batch reached `status` at `created_at` and queue a message to each of its
    owner's enabled endpoints that takes the event; returns the event's id."""
    owner = session.scalar(select(Batch.owner).where(Batch.id == batch_id))
    return _record(session, owner, EVENT_TYPES[status], created_at, batch_id=batch_id)


def record_response_event(
    session: Session, response_id: str, status: ResponseStatus, created_at: int
) -> str:
    """Record that the background response reached `status` at `created_at` and queue a message
    to each of its owner's enabled endpoints that takes the event; returns the event's id."""
    owner = session.scalar(select(StoredResponse.owner).where(StoredResponse.id == response_id))
    return _record(
        session, owner, RESPONSE_EVENT_TYPES[status], created_at, response_id=response_id
    )


def _record(
    session: Session,
    owner: str,
    event_type: str,
    created_at: int,
    batch_id: str | None = None,
    response_id: str | None = None,
) -> str:
    event = WebhookEvent(
        id=new_id("evt_"),
        owner=owner,
        type=event_type,
        batch_id=batch_id,
        response_id=response_id,
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


def new_messages(
    session: Session, *, batch_id: str | None = None, response_id: str | None = None
) -> list[str]:
    """The messages of the batch's (or the response's) event not yet attempted: what the
    transaction that recorded it leaves for delivery to start on."""
    subject = (
        WebhookEvent.batch_id == batch_id
        if batch_id is not None
        else WebhookEvent.response_id == response_id
    )
    return list(
        session.scalars(
            select(WebhookMessage.id)
            .join(WebhookEvent, WebhookEvent.id == WebhookMessage.event_id)
            .where(
                subject,
                WebhookMessage.status == WebhookMessageStatus.PENDING,
                WebhookMessage.attempts == 0,
            )
        ).all()
    )
