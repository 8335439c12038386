"""The Celery app of the distributed deployment: the same task functions, on Redis.

Crash recovery does not rest on `acks_late` alone (Redis redelivers an unacknowledged task only
after its visibility timeout), nor on the broker keeping its queue: shards hold leases in the job
store, and each worker's upkeep (workers/upkeep.py, on timers of its own, not Celery beat)
re-queues the shards of dead workers and the work a restarted broker lost.

A worker outlives broker restarts and outages of any length: it reconnects and goes on taking
tasks. Celery 5.7.0 did not (a worker holding an unacknowledged task when Redis went away died
in its reconnect, tests/workers/test_broker_restart.py): constraints.txt holds the Celery that
passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from pagedbatch.settings import Settings
from pagedbatch.workers.tasks import TASKS

QUEUE = "pagedbatch"
# A scrape of the queue depth waits no longer than this for Redis.
DEPTH_TIMEOUT_SECONDS = 2.0


class CeleryQueue:
    def __init__(self, app: Celery):
        self.app = app
        self._redis: redis.Redis | None = None

    def enqueue(self, task: str, *args: Any, delay: float = 0.0) -> None:
        # A countdown past Redis's visibility timeout gets the task delivered more than once;
        # delayed tasks (webhook retries) claim their work in the job store, so extra copies
        # find nothing to do.
        self.app.send_task(task, args=args, queue=QUEUE, countdown=delay or None)

    def depths(self) -> dict[str, int]:
        """Messages waiting in the broker: the length of the queue's Redis list. Tasks a worker
        has taken (delayed ones included) are no longer in it."""
        if self._redis is None:
            self._redis = redis.Redis.from_url(
                self.app.conf.broker_url, socket_timeout=DEPTH_TIMEOUT_SECONDS
            )
        return {QUEUE: self._redis.llen(QUEUE)}


def make_celery(settings: Settings, run: Callable[[str, tuple[Any, ...]], None]) -> Celery:
    """A Celery app whose tasks call `run(name, args)` (on workers, the worker's context)."""
    app = Celery("pagedbatch", broker=settings.broker_url)
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Past Celery's default of 100 tries (about 50 minutes of an outage) the worker would
        # give up and exit: it retries for as long as the broker is away, at most every 30 s.
        broker_connection_max_retries=None,
    )
    for name in TASKS:
        app.task(name=name, ignore_result=True)(_bind(run, name))
    return app


def _bind(run: Callable[[str, tuple[Any, ...]], None], name: str) -> Callable[..., None]:
    def task(*args: Any) -> None:
        run(name, args)

    task.__name__ = name
    return task
