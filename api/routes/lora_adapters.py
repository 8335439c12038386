"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's routes and bodies):
an operator adds a LoRA adapter to the engine at run time, or removes one.

Admin only (`require_admin`): the path is a folder on the server, which a tenant must not name.
A load reads and checks the folder before anything is registered (its sizes bounded: see
engine/lora/adapter.py); any fault is a 400 and changes nothing. An unload of an adapter that
unfinished requests run with is a 409 and changes nothing: requests are never cut short by it;
the operator unloads once they are done (a tenant's new requests for it can be kept out in the
meantime by no other means, so the 409 names how many remain).

The distributed API runs no engine: adapters are loaded on its workers (`lora_modules`), whose
engine hosts advertise them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedbatch.api.auth import require_admin
from pagedbatch.api.deps import ServicesDep
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.costs import price_adapters
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.lora.registry import LoraInUse, LoraNameError, UnknownLora
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.common import parse_request

router = APIRouter(tags=["lora"], dependencies=[Depends(require_admin)])

MAX_PATH = 4096
# What succeeded, in vLLM's words, as text; errors are JSON (`error_responses`).
DONE: dict[int | str, dict[str, Any]] = {
    200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH)


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body may carry it; names alone identify adapters


def _engine(services: ServicesDep) -> AsyncLLM:
    if services.engine is None:
        raise OpenAIError(
            "This API runs no engine: LoRA adapters are loaded on its workers (lora_modules).",
            code="unsupported",
        )
    return services.engine


@router.post(
    "/load_lora_adapter",
    response_model=None,
    responses=DONE | error_responses(400, 401, "4XX"),
    openapi_extra=json_body(LoadLoraAdapter),
)
async def load_lora_adapter(
    services: ServicesDep, body: Annotated[Any, Body()] = None
) -> PlainTextResponse:
    params = parse_request(LoadLoraAdapter, body)
    engine = _engine(services)
    try:
        await engine.load_lora(params.lora_name, Path(params.lora_path))
    except LoraNameError as e:
        raise OpenAIError(str(e), param="lora_name") from None
    except ValueError as e:
        raise OpenAIError(str(e), param="lora_path") from None
    # The service's one price table, which the spend guard and the ledger read: priced as its
    # model unless the operator priced it, the adapter's usage counts against spend limits.
    price_adapters(services.settings.prices, [params.lora_name], engine.engine.model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{params.lora_name}' added successfully.")


@router.post(
    "/unload_lora_adapter",
    response_model=None,
    responses=DONE | error_responses(400, 401, 404, 409, "4XX"),
    openapi_extra=json_body(UnloadLoraAdapter),
)
async def unload_lora_adapter(
    services: ServicesDep, body: Annotated[Any, Body()] = None
) -> PlainTextResponse:
    params = parse_request(UnloadLoraAdapter, body)
    engine = _engine(services)
    try:
        await engine.unload_lora(params.lora_name)
    except UnknownLora as e:
        raise OpenAIError(
            str(e), status_code=404, param="lora_name", code="lora_not_found"
        ) from None
    except LoraInUse as e:
        raise OpenAIError(str(e), status_code=409, param="lora_name", code="lora_in_use") from None
    return PlainTextResponse(f"Success: LoRA adapter '{params.lora_name}' removed successfully.")
