"""What routes receive through FastAPI's dependency injection."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import anyio
from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.api.preparation import Preparation
from pagedbatch.api.token_rate import TokenRate
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.async_llm import first_dead
from pagedbatch.ids import now
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import BlobStore
from pagedbatch.store.queue import TaskQueue
from pagedbatch.store.usage import LedgerWriter

if TYPE_CHECKING:  # it serves the realtime routes, which use this module
    from pagedbatch.api.engine_proxy import EngineProxy


@dataclass
class Services:
    """The process's shared resources, built once by whoever starts the app."""

    settings: Settings
    session_factory: sessionmaker[Session]
    blobs: BlobStore
    queue: TaskQueue | None = None  # where batch work goes; None in a Files-only app
    served_models: list[str] = field(default_factory=list)  # default: the engine's model
    engine: AsyncLLM | None = None  # serves the realtime endpoints; None in the distributed API
    engines: EngineProxy | None = None  # the distributed API's way to the workers' engines
    guard: AsyncLLM | None = None  # the moderation model's engine, where one is configured
    embedder: AsyncLLM | None = None  # the embedding model's engine, where one is configured
    # The name the embedding model is served under (the distributed API's: its workers run it).
    embedding_model: str | None = None
    ledger: LedgerWriter | None = None  # records realtime requests' usage, where they run
    started_at: int = field(default_factory=now)  # reported as each served model's `created`
    # An upload holds a thread for as long as its client takes to send it, so uploads get threads
    # of their own: slow ones cannot take the pool that sync endpoints and downloads run on.
    # Uploads beyond this many wait their turn.
    upload_threads: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(32))
    # Realtime requests are parsed, templated and tokenized on threads, shared fairly among
    # tenants: a large one takes seconds of CPU, which must not stall the event loop (and
    # /health); one that fetches images waits on threads of its own (api/preparation.py).
    preparation: Preparation = field(default_factory=Preparation)
    # The engine's generated tokens per second, as `/v1/engine/stats` reports it.
    generation_rate: TokenRate = field(default_factory=TokenRate)

    def __post_init__(self) -> None:
        if self.engine is not None and not self.served_models:
            self.served_models = [self.engine.engine.model_name]  # the model it serves
        if self.embedder is not None:
            self.embedding_model = self.embedder.engine.model_name

    def dead_engine(self) -> AsyncLLM | None:
        """The first of this process's engines whose thread has died (see `first_dead`)."""
        return first_dead((self.engine, self.guard, self.embedder))

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters this process's engine serves, each with the model it adapts."""
        if self.engine is None:
            return {}
        return {name: self.engine.engine.model_name for name in self.engine.engine.lora_names}

    async def parents(self) -> dict[str, str]:
        """`adapters`, and in the distributed API those the live engine hosts advertise."""
        live = {} if self.engines is None else await self.engines.adapters()
        return live | self.adapters()

    async def models(self) -> list[str]:
        """The served models: the configured ones (the embedding model's among them), the LoRA
        adapters of this process's engine, and the models and adapters of the live engines."""
        configured = [
            *self.served_models,
            *([self.embedding_model] if self.embedding_model else []),
            *self.adapters(),
        ]
        if self.engines is None:
            return configured
        live = [*await self.engines.models(), *await self.engines.adapters()]
        return [*configured, *sorted(set(live) - set(configured))]


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    with services.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
