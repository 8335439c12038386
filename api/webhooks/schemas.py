"""Webhook endpoints and their delivery log, as `/v1/webhook_endpoints` shows them.

OpenAI configures webhooks in its dashboard, so these objects are ours; they follow OpenAI's
conventions (an `object` name, Unix-second times, cursor-paged lists).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedbatch.store.models import WebhookDelivery, WebhookEndpoint

# store/webhooks.py's EVENT_TYPES and RESPONSE_EVENT_TYPES (background responses' ends), spelled
# out for the OpenAPI document.
EventType = Literal[
    "batch.completed",
    "batch.failed",
    "batch.cancelled",
    "batch.expired",
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
]

MAX_URL_LENGTH = 2048  # WebhookEndpoint.url's column


class WebhookEndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    # The event types to send; omitted or null: every type.
    events: list[EventType] | None = Field(None, min_length=1)

    @field_validator("url")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:  # PostgreSQL text cannot hold it
            raise ValueError("it contains a NUL character")
        return value


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[EventType] | None
    status: Literal["enabled", "disabled"]
    disabled_reason: str | None
    created_at: int

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(
            id=row.id,
            url=row.url,
            events=row.events,
            status="enabled" if row.disabled_at is None else "disabled",
            disabled_reason=row.disabled_reason,
            created_at=row.created_at,
        )


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """What creating an endpoint or rotating its secret returns: the only time the secret is
    shown. Verify deliveries with it, e.g. `client.webhooks.unwrap(body, headers, secret=...)`."""

    secret: str

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookEndpointWithSecret:
        return cls(**WebhookEndpointObject.from_row(row).model_dump(), secret=row.secret)


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool = True


class WebhookDeliveryObject(BaseModel):
    """One attempt to deliver an event to the endpoint."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_id: str  # the `webhook-id` header: the same on every attempt of one event
    event_id: str
    event_type: EventType
    batch_id: str | None  # the event's subject: a batch, or a background response
    response_id: str | None
    attempt: int
    outcome: Literal["delivered", "failed", "disabled"]
    status_code: int | None
    latency_ms: int | None
    error: str | None
    created_at: int

    @classmethod
    def from_row(
        cls, row: tuple[WebhookDelivery, str, str, str | None, str | None]
    ) -> WebhookDeliveryObject:
        delivery, event_id, event_type, batch_id, response_id = row
        return cls(
            id=delivery.id,
            webhook_id=delivery.message_id,
            event_id=event_id,
            event_type=event_type,
            batch_id=batch_id,
            response_id=response_id,
            attempt=delivery.attempt,
            outcome=delivery.outcome,
            status_code=delivery.status_code,
            latency_ms=delivery.latency_ms,
            error=delivery.error,
            created_at=delivery.created_at,
        )
