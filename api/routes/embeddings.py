"""`/v1/embeddings`: texts or token ids in, one vector each out, from the embedding model (the
one PAGEDBATCH_EMBEDDING_MODEL serves beside the main model, or the main model where it is one);
the request's `model` picks which (api/realtime.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.realtime import answer, json_of
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.protocol.schemas.embeddings import CreateEmbeddingResponse, EmbeddingRequest
from pagedbatch.protocol.serving.embeddings import prepare_embedding

router = APIRouter(prefix="/embeddings", tags=["embeddings"])


@router.post(
    "",
    response_model=CreateEmbeddingResponse,
    responses=error_responses(404),
    openapi_extra=json_body(EmbeddingRequest),
)
async def create_embedding(request: Request, services: ServicesDep) -> Response:
    return await answer(request, services, json_of(EmbeddingRequest), prepare_embedding)
