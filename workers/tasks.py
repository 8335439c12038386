"""The task table: every task by name, as both queues run them, and the timers every process
that runs tasks keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedbatch.settings import Settings
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.workers.batches.finalize import finalize_batch
from pagedbatch.workers.batches.shards import run_shard
from pagedbatch.workers.batches.validation import validate_batch
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import heartbeat
from pagedbatch.workers.responses import run_response
from pagedbatch.workers.upkeep import tick_seconds, upkeep
from pagedbatch.workers.webhooks import deliver_webhook

TASKS: dict[str, Callable[..., None]] = {
    "validate_batch": validate_batch,
    "run_shard": run_shard,
    "finalize_batch": finalize_batch,
    "run_response": run_response,
    "deliver_webhook": deliver_webhook,
    # Run by each process's own timers (start_timers), never sent through a broker.
    "heartbeat": heartbeat,
    "upkeep": upkeep,
}


def start_timers(timers: InProcessQueue, settings: Settings) -> None:
    """The heartbeat and upkeep, on `timers`' threads: in the embedded server its task queue, in
    a worker a queue of its own beside Celery's."""
    timers.every(settings.worker_heartbeat_seconds, "heartbeat")
    timers.every(tick_seconds(settings), "upkeep")


def run_task(ctx: WorkerContext, name: str, args: tuple[Any, ...]) -> None:
    TASKS[name](ctx, *args)
