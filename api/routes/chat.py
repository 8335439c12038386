"""`/v1/chat/completions`: a conversation in, the assistant's reply out, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.realtime import answer, json_of
from pagedbatch.api.routes.openapi import error_responses, json_body, streamed
from pagedbatch.protocol.schemas.chat import ChatCompletion, ChatCompletionRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.streaming import ChatChunks, chunked

router = APIRouter(prefix="/chat", tags=["chat"])


@router.post(
    "/completions",
    response_model=None,
    responses={**streamed(ChatCompletion), **error_responses(404)},
    openapi_extra=json_body(ChatCompletionRequest),
)
async def create_chat_completion(request: Request, services: ServicesDep) -> Response:
    return await answer(
        request, services, json_of(ChatCompletionRequest), prepare_chat, chunked(ChatChunks)
    )
