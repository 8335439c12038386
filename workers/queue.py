"""How tasks are handed to workers: Celery on Redis (distributed) or a thread pool (embedded).

Both run the same task functions (workers/tasks.py) by name, so the embedded server is a
deployment of the distributed design, not a second implementation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class TaskQueue(Protocol):
    def enqueue(self, task: str, *args: Any) -> None: ...


class InProcessQueue:
    """Runs tasks on thread pools in this process, and periodic tasks on timers.

    Tasks named in `lanes` get a pool of their own of the given size: shard runs hold a thread
    for as long as a shard takes, and must not starve validation or finalization.
    """

    def __init__(
        self,
        run: Callable[[str, tuple[Any, ...]], None],
        lanes: dict[str, int] | None = None,
        max_workers: int = 4,
    ):
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="task")
        self._lanes = {
            task: ThreadPoolExecutor(max_workers=size, thread_name_prefix=task)
            for task, size in (lanes or {}).items()
        }
        self._stop = threading.Event()
        self._timers: list[threading.Thread] = []

    def enqueue(self, task: str, *args: Any) -> None:
        if not self._stop.is_set():
            self._lanes.get(task, self._pool).submit(self._safe_run, task, args)

    def _safe_run(self, task: str, args: tuple[Any, ...]) -> None:
        try:
            self._run(task, args)
        except Exception:  # noqa: BLE001 - a failed task must not kill the pool; it is retried
            logger.exception("task %s%s failed", task, args)

    def every(self, seconds: float, task: str) -> None:
        def loop() -> None:
            while not self._stop.wait(seconds):
                self._safe_run(task, ())

        timer = threading.Thread(target=loop, name=f"every-{task}", daemon=True)
        timer.start()
        self._timers.append(timer)

    def shutdown(self) -> None:
        self._stop.set()
        for pool in (self._pool, *self._lanes.values()):
            pool.shutdown(wait=True, cancel_futures=True)
        for timer in self._timers:
            timer.join()
