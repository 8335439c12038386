"""What a batch endpoint runs on in this worker: the engine its lines go to (the main one, the
moderation guard for `/v1/moderations`, the embedding model's for `/v1/embeddings` where one is
configured) and how a line's body becomes that engine's requests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from pagedbatch.engine import AsyncLLM
from pagedbatch.protocol.batch_lines import EMBEDDINGS, ENDPOINTS, MODERATIONS
from pagedbatch.protocol.schemas.moderations import ModerationRequest
from pagedbatch.protocol.serving.common import Prepared, ServedModel, parse_request
from pagedbatch.protocol.serving.moderations import OPENAI_MODELS, prepare_moderation
from pagedbatch.settings import Settings
from pagedbatch.workers.context import WorkerContext


@dataclass(frozen=True)
class Endpoint:
    engine: AsyncLLM
    prepare: Callable[[Any, ServedModel], Prepared]  # (line body, engine) -> its requests
    aliases: frozenset[str] = frozenset()  # other names a line may give the engine's model

    @property
    def model(self) -> str:
        return self.engine.engine.model_name

    def serves(self, model: str) -> bool:
        """Its model, an alias, or a LoRA adapter served on it."""
        return (
            model == self.model or model in self.aliases or model in self.engine.engine.lora_names
        )


def endpoint(ctx: WorkerContext, url: str) -> Endpoint | None:
    """The endpoint `url` of this worker; None when it has no engine for it."""
    if url == MODERATIONS:
        if ctx.guard is None:
            return None
        prepare = partial(_prepare_moderation, settings=ctx.settings)
        return Endpoint(ctx.guard, prepare, OPENAI_MODELS)
    if url == EMBEDDINGS and ctx.embedder is not None:
        return Endpoint(ctx.embedder, ENDPOINTS[url])
    if ctx.engine is None:
        return None
    return Endpoint(ctx.engine, ENDPOINTS[url])


def _prepare_moderation(body: Any, guard: ServedModel, settings: Settings) -> Prepared:
    request = parse_request(ModerationRequest, body)
    return prepare_moderation(
        request, guard, settings.safety_threshold, settings.max_moderation_inputs
    )
