"""`/v1/models`: the model(s) this deployment serves (distributed: the configured one and those
of the live engines)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.lists import ListPage
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.protocol.errors import OpenAIError

router = APIRouter(prefix="/models", tags=["models"])


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedbatch"
    parent: str | None = None  # a LoRA adapter's: the model it adapts (vLLM's field)


@router.get("")
async def list_models(services: ServicesDep) -> ListPage[Model]:
    parents = await services.parents()
    models = [
        Model(id=name, created=services.started_at, parent=parents.get(name))
        for name in await services.models()
    ]
    return ListPage[Model].from_rows(models, len(models), lambda model: model)


# `:path` because served names are often Hugging Face ids such as `org/name`.
@router.get("/{model:path}", responses=error_responses(404))
async def retrieve_model(model: str, services: ServicesDep) -> Model:
    if model not in await services.models():
        raise OpenAIError(
            f"The model '{model}' does not exist",
            status_code=404,
            param="model",
            code="model_not_found",
        )
    parent = (await services.parents()).get(model)
    return Model(id=model, created=services.started_at, parent=parent)
