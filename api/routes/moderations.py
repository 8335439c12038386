"""`/v1/moderations`: texts in, each one's category scores out, from the served guard."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from pagedbatch.api.deps import Services, ServicesDep
from pagedbatch.api.realtime import answer, forward_to_any_host, json_of
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.engine import AsyncLLM
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.moderations import ModerationCreateResponse, ModerationRequest
from pagedbatch.protocol.serving.common import ServedModel
from pagedbatch.protocol.serving.moderations import PreparedModeration, prepare_moderation

router = APIRouter(prefix="/moderations", tags=["moderations"])


def _guard(services: Services, model: str | None) -> AsyncLLM:
    if services.guard is None:
        raise OpenAIError(
            "This server runs no moderation model (set PAGEDBATCH_MODERATION_MODEL).",
            status_code=404,
            param="model",
            code="model_not_found",
        )
    return services.guard


@router.post(
    "",
    response_model=ModerationCreateResponse,
    responses=error_responses(404),
    openapi_extra=json_body(ModerationRequest),
)
async def create_moderation(request: Request, services: ServicesDep) -> Response:
    settings = services.settings
    if services.engines is not None:  # every worker runs the moderation model beside its own
        return await forward_to_any_host(request, services)

    def prepare(params: ModerationRequest, guard: ServedModel) -> PreparedModeration:
        threshold, most = settings.safety_threshold, settings.max_moderation_inputs
        return prepare_moderation(params, guard, threshold, most)

    return await answer(request, services, json_of(ModerationRequest), prepare, engine_of=_guard)
