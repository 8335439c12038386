"""Webhook endpoints: where a tenant hears of its batches' and background responses' ends, and
the log of each delivery.

A URL is refused at registration if it leads anywhere but the public internet (see
pagedbatch/egress.py); delivery checks it again, as names can be re-pointed.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from pydantic import ValidationError
from sqlalchemy import ColumnElement, func, select, tuple_
from sqlalchemy.orm import Session

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.deps import ServicesDep, SessionDep
from pagedbatch.api.lists import ListPage, unknown_cursor
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.api.webhooks.schemas import (
    WebhookDeliveryObject,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
)
from pagedbatch.egress import ForbiddenDestination, check_url
from pagedbatch.ids import new_id, now
from pagedbatch.protocol.errors import OpenAIError, from_validation_error
from pagedbatch.protocol.webhook_signing import new_secret
from pagedbatch.store.models import WebhookDelivery, WebhookEndpoint, WebhookEvent, WebhookMessage

router = APIRouter(prefix="/webhook_endpoints", tags=["webhooks"])


def get_endpoint(session: Session, owner: str, endpoint_id: str) -> WebhookEndpoint:
    row = session.scalar(
        select(WebhookEndpoint).where(
            WebhookEndpoint.id == endpoint_id, WebhookEndpoint.owner == owner
        )
    )
    if row is None:
        raise OpenAIError(
            f"No such webhook endpoint: {endpoint_id}",
            status_code=404,
            param="endpoint_id",
            code="not_found",
        )
    return row


@router.post("", openapi_extra=json_body(WebhookEndpointCreate))
def create_endpoint(
    session: SessionDep,
    owner: OwnerDep,
    services: ServicesDep,
    body: Annotated[Any, Body()] = None,
) -> WebhookEndpointWithSecret:
    try:
        params = WebhookEndpointCreate.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e, body) from None
    limit = services.settings.webhook_max_endpoints_per_tenant
    registered = session.scalar(
        select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.owner == owner)
    )
    if registered >= limit:
        # Not 409 or 429: the SDK retries those, and only a deletion can help.
        raise OpenAIError(
            f"You have {registered} webhook endpoints, the most allowed is {limit}; "
            "delete one to add another.",
            code="too_many_endpoints",
        )
    try:
        check_url(params.url, services.settings.webhook_allowed_hosts)
    except ForbiddenDestination as e:
        raise OpenAIError(
            f"Invalid value for 'url': {e}.", param="url", code="invalid_value"
        ) from None
    row = WebhookEndpoint(
        id=new_id("whep_"),
        owner=owner,
        url=params.url,
        events=params.events,
        secret=new_secret(),
        created_at=now(),
    )
    session.add(row)
    session.commit()
    return WebhookEndpointWithSecret.from_row(row)


@router.get("")
def list_endpoints(
    session: SessionDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> ListPage[WebhookEndpointObject]:
    """Newest first."""
    query = select(WebhookEndpoint).where(WebhookEndpoint.owner == owner)
    if after is not None:
        cursor = session.scalar(
            select(WebhookEndpoint).where(
                WebhookEndpoint.id == after, WebhookEndpoint.owner == owner
            )
        )
        if cursor is None:
            raise unknown_cursor("webhook endpoint", after)
        query = query.where(
            tuple_(WebhookEndpoint.created_at, WebhookEndpoint.id)
            < tuple_(cursor.created_at, cursor.id)
        )
    rows = session.scalars(
        query.order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc()).limit(
            limit + 1
        )
    ).all()
    return ListPage[WebhookEndpointObject].from_rows(rows, limit, WebhookEndpointObject.from_row)


@router.get("/{endpoint_id}", responses=error_responses(404))
def retrieve_endpoint(
    endpoint_id: str, session: SessionDep, owner: OwnerDep
) -> WebhookEndpointObject:
    return WebhookEndpointObject.from_row(get_endpoint(session, owner, endpoint_id))


@router.delete("/{endpoint_id}", responses=error_responses(404))
def delete_endpoint(
    endpoint_id: str, session: SessionDep, owner: OwnerDep
) -> WebhookEndpointDeleted:
    """Its undelivered events and its delivery log go with it."""
    session.delete(get_endpoint(session, owner, endpoint_id))
    session.commit()
    return WebhookEndpointDeleted(id=endpoint_id)


@router.post("/{endpoint_id}/rotate_secret", responses=error_responses(404))
def rotate_secret(
    endpoint_id: str, session: SessionDep, owner: OwnerDep, services: ServicesDep
) -> WebhookEndpointWithSecret:
    """A new secret, shown once. Deliveries carry a signature by the old one too for
    `webhook_secret_grace_seconds`, so the receiver can switch without rejecting any."""
    row = get_endpoint(session, owner, endpoint_id)
    grace = services.settings.webhook_secret_grace_seconds
    row.previous_secret = row.secret if grace > 0 else None
    row.previous_secret_expires_at = now() + grace if grace > 0 else None
    row.secret = new_secret()
    session.commit()
    return WebhookEndpointWithSecret.from_row(row)


@router.get("/{endpoint_id}/deliveries", responses=error_responses(404))
def list_deliveries(
    endpoint_id: str,
    session: SessionDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> ListPage[WebhookDeliveryObject]:
    """Every attempt to deliver an event to the endpoint, newest first."""
    endpoint = get_endpoint(session, owner, endpoint_id)
    query = (
        select(
            WebhookDelivery,
            WebhookEvent.id,
            WebhookEvent.type,
            WebhookEvent.batch_id,
            WebhookEvent.response_id,
        )
        .join(WebhookMessage, WebhookMessage.id == WebhookDelivery.message_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookMessage.event_id)
        .where(WebhookDelivery.endpoint_id == endpoint.id)
    )
    if after is not None:
        query = query.where(_older_delivery(session, endpoint.id, after))
    rows = session.execute(
        query.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc()).limit(
            limit + 1
        )
    ).all()
    return ListPage[WebhookDeliveryObject].from_rows(
        [tuple(row) for row in rows], limit, WebhookDeliveryObject.from_row
    )


def _older_delivery(session: Session, endpoint_id: str, after: str) -> ColumnElement[bool]:
    cursor = session.scalar(
        select(WebhookDelivery).where(
            WebhookDelivery.id == after, WebhookDelivery.endpoint_id == endpoint_id
        )
    )
    if cursor is None:
        raise unknown_cursor("webhook delivery", after)
    return tuple_(WebhookDelivery.created_at, WebhookDelivery.id) < tuple_(
        cursor.created_at, cursor.id
    )
