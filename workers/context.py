"""What a task needs to run: settings, the job store, blob storage, the queue, and (on workers)
the engine. One context per process; the embedded server and each worker build their own."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.async_llm import first_dead
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import BlobStore
from pagedbatch.store.queue import TaskQueue


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Liveness:
    """What this process knows of its own upkeep: its heartbeats (workers/heartbeats.py) and
    when each upkeep job last ran here (workers/upkeep.py)."""

    # Monotonic; None until a heartbeat goes through, and again after one fails.
    beating_since: float | None = None
    last_runs: dict[str, float] = field(default_factory=dict)  # job name -> monotonic time


@dataclass
class WorkerContext:
    settings: Settings
    session_factory: sessionmaker[Session]
    blobs: BlobStore
    queue: TaskQueue
    engine: AsyncLLM | None = None  # only processes that run shards have one
    guard: AsyncLLM | None = None  # the moderation model's engine, where one is configured
    embedder: AsyncLLM | None = None  # the embedding model's engine, where one is configured
    worker_id: str = field(default_factory=default_worker_id)
    shard_slots: threading.BoundedSemaphore = field(init=False)
    liveness: Liveness = field(default_factory=Liveness)
    # Set when the process begins to shut down: running shards stop at once and hand their shard
    # back (pending, its finished lines kept) rather than hold the shutdown until they end.
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        # However many task threads the queue has, this engine runs this many shards at once.
        self.shard_slots = threading.BoundedSemaphore(self.settings.worker_concurrency)

    def dead_engine(self) -> AsyncLLM | None:
        """The first of this process's engines whose thread has died (see `first_dead`)."""
        return first_dead((self.engine, self.guard, self.embedder))
