"""The in-process task queue: tasks now, tasks after a delay, and what shutdown drops."""

from __future__ import annotations

import threading
import time

from pagedbatch.store.queue import InProcessQueue


def test_a_delayed_task_runs_after_its_delay_and_in_due_order():
    ran: list[tuple[str, float]] = []
    done = threading.Event()

    def run(name: str, args: tuple) -> None:
        ran.append((args[0], time.monotonic()))
        if len(ran) == 3:
            done.set()

    queue = InProcessQueue(run, max_workers=1)
    start = time.monotonic()
    queue.enqueue("task", "late", delay=0.4)
    queue.enqueue("task", "soon", delay=0.2)
    queue.enqueue("task", "now")
    assert done.wait(5)
    queue.shutdown()

    assert [name for name, _ in ran] == ["now", "soon", "late"]
    at = {name: moment - start for name, moment in ran}
    assert at["soon"] >= 0.2 and at["late"] >= 0.4


def test_shutdown_drops_delayed_tasks_without_waiting_for_them():
    ran: list[tuple] = []
    queue = InProcessQueue(lambda name, args: ran.append(args))
    queue.enqueue("task", "later", delay=30)
    start = time.monotonic()
    queue.shutdown()
    assert time.monotonic() - start < 5
    queue.enqueue("task", "after shutdown", delay=0.01)
    time.sleep(0.1)
    assert ran == []
