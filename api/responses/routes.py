"""`/v1/responses`: input items in, a Response out, whole or as its typed stream events.

Create answers through the realtime door (api/realtime.py `answer`), as chat does: parsed and
prepared off the event loop, the spend reserved, admitted, run through the request pipeline. With
`background: true` it is saved and queued instead (api/responses/background.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi import Response as HTTPResponse

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.preparation import preparing_for
from pagedbatch.api.realtime import answer, json_of, tenant_of
from pagedbatch.api.responses.background import create_in_background
from pagedbatch.api.responses.stored import continuing, keeper
from pagedbatch.api.routes.openapi import error_responses, json_body, streamed
from pagedbatch.protocol.schemas.responses import Response, ResponseCreateRequest
from pagedbatch.protocol.serving.common import ServedModel, not_supported
from pagedbatch.protocol.serving.response_stream import ResponseEvents
from pagedbatch.protocol.serving.responses import PreparedResponse, prepare_response
from pagedbatch.store.responses import Conversation

router = APIRouter(prefix="/responses", tags=["responses"])


@router.post(
    "",
    response_model=None,
    responses={**streamed(Response, typed=True), **error_responses(404)},
    openapi_extra=json_body(ResponseCreateRequest),
)
async def create_response(request: Request, services: ServicesDep) -> HTTPResponse:
    owner = tenant_of(request)
    raw = await request.body()
    # Parsed here only where it may ask for the background, and only where it is prepared (the
    # distributed API forwards it to an engine host, which comes here).
    if services.engines is None and b'"background"' in raw:
        preparing_for.set(owner)  # the preparation threads' fair share is the tenant's
        params = await services.preparation.work.run(json_of(ResponseCreateRequest), raw)
        if params.background:
            return await create_in_background(request, services, owner, params)

    def prepare(params: ResponseCreateRequest, served: ServedModel) -> PreparedResponse:
        # On a preparation thread: the conversation is read from the job store.
        return _prepare(params, served, continuing(services, owner, params))

    return await answer(
        request,
        services,
        json_of(ResponseCreateRequest),
        prepare,
        lambda prepared, _: ResponseEvents(prepared),
        on_answered=keeper(services, owner),
    )


def _prepare(
    request: ResponseCreateRequest, served: ServedModel, history: Conversation
) -> PreparedResponse:
    if request.background:
        raise not_supported("background", "background")
    return prepare_response(request, served, history.items, not history.whole)
