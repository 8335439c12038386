"""How tasks are handed to workers: Celery on Redis (distributed) or a thread pool (embedded).

Both run the same task functions (workers/tasks.py) by name, so the embedded server is a
deployment of the distributed design, not a second implementation. The API reads the depth of
the queues for its `/metrics`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

DEFAULT_LANE = "default"  # the in-process pool of every task without a lane of its own


class TaskQueue(Protocol):
    def enqueue(self, task: str, *args: Any, delay: float = 0.0) -> None:
        """Run `task(*args)` on some worker, no sooner than `delay` seconds from now."""
        ...

    def depths(self) -> dict[str, int]:
        """Tasks waiting to be picked up, per queue."""
        ...


class InProcessQueue:
    """Runs tasks on thread pools in this process, and periodic tasks on timers.

    Tasks named in `lanes` get a pool of their own of the given size: shard runs hold a thread
    for as long as a shard takes, and must not starve validation or finalization. Delayed tasks
    wait in memory and are dropped at shutdown: whoever delays a task keeps what it needs in the
    job store, where a periodic task finds it again.
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
        self._waiting: Counter[str] = Counter()  # per lane: submitted, not started
        self._waiting_lock = threading.Lock()
        self._delayed: list[tuple[float, int, str, tuple[Any, ...]]] = []  # a heap by due time
        self._delayed_changed = threading.Condition()
        self._sequence = itertools.count()  # orders tasks due at once; tuples never compare args
        self._delayer = threading.Thread(target=self._run_delayed, name="delayed", daemon=True)
        self._delayer.start()

    def enqueue(self, task: str, *args: Any, delay: float = 0.0) -> None:
        if self._stop.is_set():
            return
        if delay > 0:
            with self._delayed_changed:
                due = time.monotonic() + delay
                heapq.heappush(self._delayed, (due, next(self._sequence), task, args))
                self._delayed_changed.notify()
            return
        with self._waiting_lock:
            self._waiting[self._lane(task)] += 1
        self._lanes.get(task, self._pool).submit(self._start, task, args)

    def _lane(self, task: str) -> str:
        return task if task in self._lanes else DEFAULT_LANE

    def _start(self, task: str, args: tuple[Any, ...]) -> None:
        with self._waiting_lock:
            self._waiting[self._lane(task)] -= 1
        self._safe_run(task, args)

    def depths(self) -> dict[str, int]:
        """Tasks waiting for a thread, per pool: lanes by their task's name, the rest "default"."""
        with self._waiting_lock:
            return {lane: self._waiting[lane] for lane in (DEFAULT_LANE, *self._lanes)}

    def _run_delayed(self) -> None:
        with self._delayed_changed:
            while not self._stop.is_set():
                wait = self._delayed[0][0] - time.monotonic() if self._delayed else None
                if wait is None or wait > 0:
                    self._delayed_changed.wait(wait)
                    continue
                _, _, task, args = heapq.heappop(self._delayed)
                self.enqueue(task, *args)

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
        with self._delayed_changed:
            self._delayed_changed.notify()
        self._delayer.join()
        for pool in (self._pool, *self._lanes.values()):
            pool.shutdown(wait=True, cancel_futures=True)
        for timer in self._timers:
            timer.join()


class QueueDepthCollector(Collector):
    """Tasks waiting in each queue, read when Prometheus scrapes."""

    def __init__(self, queue: TaskQueue):
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        try:
            depths = self.queue.depths()
        except Exception as e:  # noqa: BLE001 - an unreachable broker must not hide the rest
            logger.warning("cannot read the task queue's depth: %s", e)
            return
        family = GaugeMetricFamily(
            "pagedbatch:queue_depth", "Tasks waiting to be picked up, per queue.", labels=["queue"]
        )
        for name, depth in sorted(depths.items()):
            family.add_metric([name], depth)
        yield family

    def describe(self) -> Iterator[Metric]:
        # Without it the registry would read the queue at registration, to learn the name.
        yield GaugeMetricFamily("pagedbatch:queue_depth", "", labels=["queue"])
