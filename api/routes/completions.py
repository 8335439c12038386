"""`/v1/completions` (legacy): prompts in, their continuations out, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.realtime import answer, json_of
from pagedbatch.api.routes.openapi import error_responses, json_body, streamed
from pagedbatch.protocol.schemas.completions import Completion, CompletionRequest
from pagedbatch.protocol.serving.completions import prepare_completion
from pagedbatch.protocol.serving.streaming import CompletionChunks, chunked

router = APIRouter(prefix="/completions", tags=["completions"])


@router.post(
    "",
    response_model=None,
    responses={**streamed(Completion), **error_responses(404)},
    openapi_extra=json_body(CompletionRequest),
)
async def create_completion(request: Request, services: ServicesDep) -> Response:
    return await answer(
        request, services, json_of(CompletionRequest), prepare_completion, chunked(CompletionChunks)
    )
