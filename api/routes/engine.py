"""`/v1/engine/stats`: how busy the engines are, for the status page, and the settings they run
with, for operators.

Every caller sees the load figures. The settings (among them the model's path on disk and every
limit in force) are an operator's business: only a request bearing an admin key gets them, or
any request while the service has no keys at all (its one user is its operator); for everyone
else `settings` is null.

Embedded, the figures come from the engine in this process; in the distributed API, from the
live engine hosts' latest heartbeats, which carry their engines' settings too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from pagedbatch.api.auth import AdminOrTenantDep
from pagedbatch.api.deps import ServicesDep
from pagedbatch.engine import LLMEngine

router = APIRouter(prefix="/engine", tags=["engine"])

EMBEDDED_ENGINE_ID = "embedded"
# The engine answers between steps, within milliseconds; one whose thread has died never does.
STATS_TIMEOUT_SECONDS = 2.0


class ResidentMemory(BaseModel):
    """What the engine's model holds in memory (on a GPU, device memory), one rank's share;
    fixed at start."""

    weights_bytes: int = Field(
        description="Float parameters and buffers (packed copies of weights included)."
    )
    quantized_bytes: int = Field(
        description="Quantized blocks the kernels multiply on (quantization gguf); 0 otherwise."
    )
    kv_cache_bytes: int = Field(
        description="The KV cache, allocated whole at start (on CPU its pages are committed as "
        "blocks are first used)."
    )


class EngineLoad(BaseModel):
    id: str
    model: str
    running: int = Field(description="Requests the engine is generating for.")
    waiting: int = Field(description="Requests queued for the engine, preempted ones included.")
    kv_usage: float = Field(description="Fraction of the KV-cache blocks in use, 0 to 1.")
    tokens_per_second: float | None = Field(
        description="Tokens generated per second over about the last 10 s; null on the first "
        "reading."
    )
    resident: ResidentMemory | None = Field(
        description="What the engine's model holds in memory; null from a worker that does not "
        "report it."
    )
    settings: dict[str, Any] | None = Field(
        description="The engine's settings in force (EngineArgs, as PAGEDBATCH_* variables and "
        "flags name them), with what it resolved at start for auto and unset ones: "
        "served_model_name, dtype, matmul_precision, quantization, device, max_model_len, "
        "num_kv_blocks, kv_cache_dtype (auto as the dtype it stores, else int8 or fp8). Null "
        "unless the "
        "request bears an admin key or the service has no keys.",
    )


class EngineStats(BaseModel):
    object: Literal["engine.stats"] = "engine.stats"
    available: bool = Field(
        description="False when this API process cannot read its engines' figures."
    )
    engines: list[EngineLoad]


@router.get("/stats")
async def engine_stats(services: ServicesDep, admin: AdminOrTenantDep) -> EngineStats:
    engine = services.engine
    if engine is None and services.engines is not None:
        hosts = await services.engines.live()
        loads = [
            EngineLoad(
                id=h.id,
                model=h.model,
                running=h.running,
                waiting=h.waiting,
                kv_usage=h.kv_usage,
                tokens_per_second=h.tokens_per_second,
                resident=h.resident,
                settings=h.settings if admin else None,
            )
            for h in hosts
        ]
        return EngineStats(available=True, engines=loads)
    if engine is None:
        return EngineStats(available=False, engines=[])
    try:
        async with asyncio.timeout(STATS_TIMEOUT_SECONDS):
            stats = await engine.get_stats()
    except TimeoutError:
        return EngineStats(available=False, engines=[])
    load = EngineLoad(
        id=EMBEDDED_ENGINE_ID,
        model=engine.engine.model_name,
        running=stats["running"],
        waiting=stats["waiting"],
        kv_usage=stats["kv_usage"],
        tokens_per_second=services.generation_rate.update(
            stats["generation_tokens"], time.monotonic()
        ),
        resident=stats["resident"],
        settings=settings_in_force(engine.engine) if admin else None,
    )
    return EngineStats(available=True, engines=[load])


def settings_in_force(engine: LLMEngine) -> dict[str, Any]:
    """`engine`'s arguments, with what it resolved at start in place of auto and unset values.
    They do not change while it runs."""
    return {
        **asdict(engine.args),
        "served_model_name": engine.model_name,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "matmul_precision": engine.runner.matmul_precision,
        "quantization": engine.runner.quantization,
        "device": str(engine.runner.device),
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.runner.num_blocks,
        "kv_cache_dtype": engine.runner.kv_cache_dtype_name,
    }
