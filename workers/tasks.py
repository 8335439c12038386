"""The task table: every task by name, as both queues run them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.finalize import finalize_batch
from pagedbatch.workers.periodic import delete_expired_files, expire_batches, reap_leases
from pagedbatch.workers.shards import run_shard
from pagedbatch.workers.validation import validate_batch
from pagedbatch.workers.webhooks import deliver_webhook, sweep_webhooks

TASKS: dict[str, Callable[..., None]] = {
    "validate_batch": validate_batch,
    "run_shard": run_shard,
    "finalize_batch": finalize_batch,
    "expire_batches": expire_batches,
    "reap_leases": reap_leases,
    "delete_expired_files": delete_expired_files,
    "deliver_webhook": deliver_webhook,
    "sweep_webhooks": sweep_webhooks,
}

# Run every `reaper_interval_seconds` by Celery beat or the embedded queue's timers.
PERIODIC = ("expire_batches", "reap_leases", "delete_expired_files", "sweep_webhooks")


def run_task(ctx: WorkerContext, name: str, args: tuple[Any, ...]) -> None:
    TASKS[name](ctx, *args)
