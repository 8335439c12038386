"""Background responses over HTTP: create with `background: true`, and
`POST /v1/responses/{id}/cancel`.

Create checks and prepares the request as a foreground one is (a bad request is a 400 at once),
saves it `queued` (store/responses.py), queues its `run_response` task on the job machinery
(workers/responses.py: a worker's engine runs it) and answers at once with the Response
`queued`, which `GET /v1/responses/{id}` then follows to its end. It runs where the request can
be prepared: in the embedded server, or on the engine host the distributed API forwards it to
(whose tokenizer it needs), which has the job store and the queue too. A task that cannot be
queued (the broker is away) is not an error: the response is saved, and upkeep queues it once
the broker is back.

Cancel is the owner's: a response that was not created in the background is a 400 (OpenAI's
"Only responses created with background can be cancelled"); one that has ended is answered as
it is, unchanged, as OpenAI does; otherwise it becomes `cancelled` (with its `response.cancelled`
webhook event) and the worker running it sees that within a moment and aborts its engine
requests.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagedbatch.api.auth import OwnerDep
from pagedbatch.api.deps import Services, ServicesDep
from pagedbatch.api.responses.stored import continuing, keep, response_not_found
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.protocol.errors import OpenAIError, insufficient_quota
from pagedbatch.protocol.schemas.responses import Response, ResponseCreateRequest
from pagedbatch.protocol.serving.common import model_not_found, not_supported
from pagedbatch.protocol.serving.media import fetches_media
from pagedbatch.protocol.serving.responses import PreparedResponse, prepare_response
from pagedbatch.store.db import transaction
from pagedbatch.store.models import ResponseStatus
from pagedbatch.store.responses import (
    RUNNING,
    ResponseNotFound,
    get_response,
    transition,
)
from pagedbatch.store.spend import SpendRefused
from pagedbatch.store.webhooks import new_messages

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/responses", tags=["responses"])


async def create_in_background(
    request: Request, services: Services, owner: str, params: ResponseCreateRequest
) -> JSONResponse:
    """The answer to a create with `background: true`: the response, saved and queued."""
    if not params.store:
        raise OpenAIError(
            "Invalid value for 'store': a background response must be stored (store=true), "
            "to be retrieved once it has ended.",
            param="store",
            code="invalid_value",
        )
    if params.stream:
        raise not_supported("Streaming a background response", "stream")
    engine = services.engine
    if params.model not in services.served_models:
        raise model_not_found(params.model)
    assert engine is not None  # the distributed API forwards background requests to a host
    try:  # a running response finishes; no new one past a limit
        request.app.state.spend.check(owner)
    except SpendRefused as refused:
        raise insufficient_quota(str(refused)) from None

    def prepare() -> PreparedResponse:
        history = continuing(services, owner, params)
        return prepare_response(params, engine.engine, history.items, not history.whole)

    lane = services.preparation.fetching if fetches_media(params) else services.preparation.work
    prepared = await lane.run(prepare)
    queued = prepared.placeholder("queued").model_dump(mode="json")
    await keep(services, owner, prepared, queued)
    _enqueue(services, "run_response", prepared.id)
    return JSONResponse(queued)


@router.post(
    "/{response_id}/cancel",
    response_model=None,
    responses={200: {"model": Response}, **error_responses(404)},
)
def cancel_response(response_id: str, services: ServicesDep, owner: OwnerDep) -> JSONResponse:
    with transaction(services.session_factory) as session:
        try:
            body = get_response(session, services.blobs, owner, response_id)
        except ResponseNotFound:
            raise response_not_found(response_id) from None
        if not body.get("background"):
            raise OpenAIError(
                "Only responses created with background can be cancelled.",
                param="response_id",
                code="invalid_request",
            )
        # An end reached meanwhile (its worker finished it) leaves it as it ended.
        cancelled = ResponseStatus(body["status"]) in RUNNING and transition(
            session, response_id, ResponseStatus.CANCELLED
        )
    with services.session_factory() as session:
        if cancelled:
            for message_id in new_messages(session, response_id=response_id):
                _enqueue(services, "deliver_webhook", message_id)
        return JSONResponse(get_response(session, services.blobs, owner, response_id))


def _enqueue(services: Services, task: str, *args: str) -> None:
    """Queue `task`, or leave it to upkeep (which finds queued responses and undelivered
    webhooks again) if the broker is away: what it works on is in the job store already."""
    assert services.queue is not None
    try:
        services.queue.enqueue(task, *args)
    except Exception as e:  # noqa: BLE001 - whatever the broker's failure, upkeep queues it again
        logger.warning("could not queue %s%s (%s): upkeep will", task, args, e)
