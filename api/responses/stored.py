"""Stored responses over HTTP (store/responses.py): `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`; and the store's part in create: the conversation a
`previous_response_id` continues, and keeping the response answered (where `store`, OpenAI's
default).

Create keeps a response where it runs: in the embedded server, or on the worker's engine host
that the distributed API forwarded it to, which has the job store too. The row is committed
before the client gets its answer, so a `GET` to any API replica right after finds it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.deps import Services, ServicesDep, SessionDep
from pagedbatch.api.lists import ListPage, unknown_cursor
from pagedbatch.api.realtime import Answered
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.responses import Response, ResponseCreateRequest
from pagedbatch.protocol.serving.responses import (
    PreparedResponse,
    previous_response_not_finished,
    previous_response_not_found,
)
from pagedbatch.store.responses import (
    Conversation,
    ItemNotFound,
    ResponseNotFinished,
    ResponseNotFound,
    ResponseRecord,
    conversation,
    delete_response,
    get_response,
    list_input_items,
    save_response,
)

# The API's alone: an engine host serves create, never these (it has no tenants' keys).
router = APIRouter(prefix="/responses", tags=["responses"])


class InputItem(BaseModel):
    """An input item as it was stored: whatever its type, it has an id."""

    model_config = ConfigDict(extra="allow")

    id: str


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


@router.get(
    "/{response_id}",
    response_model=None,
    responses={200: {"model": Response}, **error_responses(404)},
)
def retrieve_response(
    response_id: str, services: ServicesDep, session: SessionDep, owner: OwnerDep
) -> JSONResponse:
    try:
        return JSONResponse(get_response(session, services.blobs, owner, response_id))
    except ResponseNotFound:
        raise response_not_found(response_id) from None


@router.delete("/{response_id}", responses=error_responses(404))
def remove_response(response_id: str, services: ServicesDep, owner: OwnerDep) -> DeletedResponse:
    try:
        delete_response(services.session_factory, services.blobs, owner, response_id)
    except ResponseNotFound:
        raise response_not_found(response_id) from None
    return DeletedResponse(id=response_id)


@router.get("/{response_id}/input_items", responses=error_responses(404))
def list_response_input_items(
    response_id: str,
    services: ServicesDep,
    session: SessionDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ListPage[InputItem]:
    """The last first by default, as OpenAI lists them. `include` (what to add to the items) is
    not read: stored items hold all of it already."""
    try:
        page = list_input_items(session, services.blobs, owner, response_id, limit, order, after)
    except ResponseNotFound:
        raise response_not_found(response_id) from None
    except ItemNotFound:
        raise unknown_cursor("input item of this response", after or "") from None
    items = [InputItem.model_validate(item) for item in page.items]
    return ListPage[InputItem](
        data=items,
        first_id=items[0].id if items else None,
        last_id=items[-1].id if items else None,
        has_more=page.has_more,
    )


def continuing(services: Services, owner: str, request: ResponseCreateRequest) -> Conversation:
    """The conversation that `request.previous_response_id` continues, as far as the settings
    let one request read it; none without one. It reads the job store: call it on a thread."""
    previous = request.previous_response_id
    if previous is None:
        return Conversation([], whole=True)
    settings = services.settings
    try:
        with services.session_factory() as session:
            return conversation(
                session,
                services.blobs,
                owner,
                previous,
                settings.response_history_max_turns,
                settings.response_history_max_bytes,
            )
    except ResponseNotFound:
        raise previous_response_not_found(previous) from None
    except ResponseNotFinished as running:
        raise previous_response_not_finished(previous, running.status) from None


def keeper(services: Services, owner: str) -> Answered[PreparedResponse]:
    """The create route's `on_answered`: keeps the owner's response where it asked to be
    stored, before the client gets it."""

    async def keep_answered(prepared: PreparedResponse, body: BaseModel) -> None:
        if prepared.request.store:
            await keep(services, owner, prepared, body.model_dump(mode="json"))

    return keep_answered


async def keep(
    services: Services, owner: str, prepared: PreparedResponse, body: dict[str, Any]
) -> None:
    """Save the owner's response as `body` (a Response as JSON: answered, or a background
    one's placeholder), on a preparation thread; committed when it returns."""
    await services.preparation.work.run(
        save_response,
        services.session_factory,
        services.blobs,
        response_record(owner, prepared, body),
        services.settings.response_retention_days,
    )


def response_record(owner: str, prepared: PreparedResponse, body: dict[str, Any]) -> ResponseRecord:
    """What the job store keeps of the owner's response: its request (less its input, which is
    kept as items), its input items and `body`."""
    request = prepared.request
    return ResponseRecord(
        id=prepared.id,
        owner=owner,
        model=prepared.model,
        created_at=prepared.created_at,
        request=request.model_dump(mode="json", exclude={"input"}, exclude_unset=True),
        input_items=prepared.input_items(),
        body=body,
        background=request.background,
        previous_response_id=request.previous_response_id,
    )


def response_not_found(response_id: str) -> OpenAIError:
    """The 404 of a response that is not the caller's: never one, deleted, expired, or another
    tenant's."""
    return OpenAIError(
        f"Response with id '{response_id}' not found.",
        status_code=404,
        param="response_id",
        code="not_found",
    )
