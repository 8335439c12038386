"""The `/v1` API: a router per resource, all behind the API-key check but the admin API's."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from pagedbatch.api.auth import get_owner
from pagedbatch.api.batches import routes as batches
from pagedbatch.api.files import routes as files
from pagedbatch.api.organization import routes as organization
from pagedbatch.api.responses import background as background_responses
from pagedbatch.api.responses import routes as responses
from pagedbatch.api.responses import stored as stored_responses
from pagedbatch.api.routes import (
    audio,
    chat,
    completions,
    embeddings,
    engine,
    lora_adapters,
    models,
    moderations,
)
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.api.webhooks import routes as webhooks
from pagedbatch.protocol.errors import OpenAIError


def reject_nul(request: Request) -> None:
    """A NUL character in a path or query parameter is a 400. PostgreSQL text cannot hold one, so
    a lookup of such an id failed there as a 500, while SQLite found nothing."""
    for name, value in [*request.path_params.items(), *request.query_params.multi_items()]:
        if "\x00" in value:
            raise OpenAIError(
                f"Invalid value for '{name}': it contains a NUL character.",
                param=name,
                code="invalid_value",
            )


api_router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(get_owner), Depends(reject_nul)],
    responses=error_responses(400, 401, "4XX"),
)
api_router.include_router(audio.router)
api_router.include_router(batches.router)
api_router.include_router(chat.router)
api_router.include_router(completions.router)
api_router.include_router(embeddings.router)
api_router.include_router(files.router)
api_router.include_router(models.router)
api_router.include_router(moderations.router)
api_router.include_router(responses.router)
api_router.include_router(stored_responses.router)
api_router.include_router(background_responses.router)  # cancel
api_router.include_router(webhooks.router)

# Routes that take admin keys as well as tenants' keys (the admin API's usage, the engines'
# stats), or admin keys alone (LoRA adapters' loading): they check them themselves.
admin_router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(reject_nul)],
    responses=error_responses(400, 401, "4XX"),
)
admin_router.include_router(engine.router)
admin_router.include_router(lora_adapters.router)  # admin keys only
admin_router.include_router(organization.router)
