"""The Batches API: create, retrieve, cancel and list batches.

Creating a batch only records it and queues its validation; the work happens on workers.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from sqlalchemy import ColumnElement, select, tuple_
from sqlalchemy.orm import Session

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.batches.schemas import SUPPORTED_ENDPOINTS, BatchCreate, BatchObject
from pagedbatch.api.deps import Services, ServicesDep, SessionDep
from pagedbatch.api.files.lookup import get_file
from pagedbatch.api.idempotency import IdempotencyKeyHeader, create_once, fingerprint
from pagedbatch.api.lists import ListPage, unknown_cursor
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.ids import new_id, now
from pagedbatch.protocol.batch_lines import EMBEDDINGS, MODERATIONS
from pagedbatch.protocol.errors import OpenAIError, insufficient_quota
from pagedbatch.protocol.serving.common import parse_request
from pagedbatch.store.batches import transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import TERMINAL, Batch, BatchStatus
from pagedbatch.store.spend import SpendRefused

router = APIRouter(prefix="/batches", tags=["batches"])

CREATE_ROUTE = "POST /v1/batches"


def get_batch(session: Session, owner: str, batch_id: str) -> Batch:
    row = session.scalar(select(Batch).where(Batch.id == batch_id, Batch.owner == owner))
    if row is None:
        raise OpenAIError(
            f"No such Batch object: {batch_id}",
            status_code=404,
            param="batch_id",
            code="not_found",
        )
    return row


def answer_then_enqueue(
    services: Services, owner: str, batch_id: str, task: str | None
) -> BatchObject:
    """The batch as this request left it ("validating" after create, "cancelling" after
    cancel, as OpenAI answers), read before `task` is enqueued: the embedded server's queue runs
    it at once and could otherwise move the batch on before the answer is read."""
    with services.session_factory() as session:
        answer = BatchObject.from_row(get_batch(session, owner, batch_id))
    if task is not None:
        services.queue.enqueue(task, batch_id)
    return answer


@router.post("", responses=error_responses(404), openapi_extra=json_body(BatchCreate))
def create_batch(
    request: Request,
    services: ServicesDep,
    owner: OwnerDep,
    body: Annotated[Any, Body()] = None,
    idempotency_key: IdempotencyKeyHeader = None,
) -> BatchObject:
    try:  # a running batch finishes; no new one past a limit
        request.app.state.spend.check(owner)
    except SpendRefused as refused:
        raise insufficient_quota(str(refused)) from None
    params = parse_request(BatchCreate, body)
    if params.endpoint not in SUPPORTED_ENDPOINTS:
        raise OpenAIError(
            f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {params.endpoint!r}",
            param="endpoint",
            code="invalid_value",
        )
    if params.endpoint == MODERATIONS and services.settings.moderation_model is None:
        raise OpenAIError(
            "This server runs no moderation model (set PAGEDBATCH_MODERATION_MODEL), so it "
            "takes no /v1/moderations batches.",
            param="endpoint",
            code="invalid_value",
        )
    if params.endpoint == EMBEDDINGS and not _embeds(services):
        raise OpenAIError(
            "This server runs no embedding model (set PAGEDBATCH_EMBEDDING_MODEL, or serve one "
            "as the main model), so it takes no /v1/embeddings batches.",
            param="endpoint",
            code="invalid_value",
        )

    def create(session: Session) -> str:
        input_file = get_file(session, owner, params.input_file_id, param="input_file_id")
        if input_file.purpose != "batch":
            raise OpenAIError(
                f"File {input_file.id} has purpose {input_file.purpose!r}; a batch needs a file "
                "uploaded with purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        created = now()
        batch = Batch(
            id=new_id("batch_"),
            owner=owner,
            endpoint=params.endpoint,
            input_file_id=input_file.id,
            completion_window=params.completion_window,
            status=BatchStatus.VALIDATING,
            metadata_=params.metadata,
            output_expires_after_seconds=(
                params.output_expires_after.seconds if params.output_expires_after else None
            ),
            created_at=created,
            expires_at=created + services.settings.completion_window_seconds,
        )
        session.add(batch)
        return batch.id

    batch_id, created = create_once(
        services.session_factory,
        owner=owner,
        route=CREATE_ROUTE,
        key=idempotency_key,
        fingerprint=fingerprint(CREATE_ROUTE, body),
        create=create,
    )
    return answer_then_enqueue(services, owner, batch_id, "validate_batch" if created else None)


def _embeds(services: Services) -> bool:
    """Whether some engine may embed: the embedding model's, or a main model that is one. The
    distributed API runs no engine, so it cannot tell of its workers' main model: a batch there
    fails line by line if it is none."""
    if services.embedding_model is not None or services.engine is None:
        return True
    return services.engine.engine.pooling is not None


@router.get("/{batch_id}", responses=error_responses(404))
def retrieve_batch(batch_id: str, session: SessionDep, owner: OwnerDep) -> BatchObject:
    return BatchObject.from_row(get_batch(session, owner, batch_id))


@router.post("/{batch_id}/cancel", responses=error_responses(404))
def cancel_batch(batch_id: str, services: ServicesDep, owner: OwnerDep) -> BatchObject:
    with transaction(services.session_factory) as session:
        batch = get_batch(session, owner, batch_id)
        if batch.status in TERMINAL:
            # Not 409: the SDK retries those, and retrying cannot help.
            raise OpenAIError(
                f"Batch {batch_id} is already {batch.status} and cannot be cancelled.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        moved = transition(session, batch_id, BatchStatus.CANCELLING)
    return answer_then_enqueue(services, owner, batch_id, "finalize_batch" if moved else None)


@router.get("")
def list_batches(
    session: SessionDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> ListPage[BatchObject]:
    """Newest first; ties on the one-second created_at broken by id."""
    query = select(Batch).where(Batch.owner == owner)
    if after is not None:
        query = query.where(_older_than(session, owner, after))
    rows = session.scalars(
        query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    ).all()
    return ListPage[BatchObject].from_rows(rows, limit, BatchObject.from_row)


def _older_than(session: Session, owner: str, after: str) -> ColumnElement[bool]:
    cursor = session.scalar(select(Batch).where(Batch.id == after, Batch.owner == owner))
    if cursor is None:
        raise unknown_cursor("Batch object", after)
    return tuple_(Batch.created_at, Batch.id) < tuple_(cursor.created_at, cursor.id)
