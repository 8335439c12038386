"""The Celery app of the distributed deployment: the same task functions, on Redis.

Crash recovery does not rest on `acks_late` alone (Redis redelivers an unacknowledged task only
after its visibility timeout): shards hold leases in the job store and the `reap_leases` beat
task re-queues those whose worker died.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from pagedbatch.settings import Settings
from pagedbatch.workers.tasks import PERIODIC, TASKS

QUEUE = "pagedbatch"


class CeleryQueue:
    def __init__(self, app: Celery):
        self.app = app

    def enqueue(self, task: str, *args: Any) -> None:
        self.app.send_task(task, args=args, queue=QUEUE)


def make_celery(settings: Settings, run: Callable[[str, tuple[Any, ...]], None]) -> Celery:
    """A Celery app whose tasks call `run(name, args)` (on workers, the worker's context)."""
    app = Celery("pagedbatch", broker=settings.broker_url)
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        beat_schedule={
            name: {"task": name, "schedule": settings.reaper_interval_seconds} for name in PERIODIC
        },
    )
    for name in TASKS:
        app.task(name=name, ignore_result=True)(_bind(run, name))
    return app


def _bind(run: Callable[[str, tuple[Any, ...]], None], name: str) -> Callable[..., None]:
    def task(*args: Any) -> None:
        run(name, args)

    task.__name__ = name
    return task
