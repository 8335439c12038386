"""The workers' side of the metrics: the depth of each task queue, in-process and in Redis, and
a worker's own metrics server."""

from __future__ import annotations

import threading

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedbatch.engine.metrics.prometheus import PREFIX
from pagedbatch.settings import Settings
from pagedbatch.store.queue import InProcessQueue, QueueDepthCollector, TaskQueue
from pagedbatch.workers.celery_app import QUEUE, CeleryQueue, make_celery
from pagedbatch.workers.metrics import serve_metrics


def scrape(queue: TaskQueue) -> list[Metric]:
    registry = CollectorRegistry()
    registry.register(QueueDepthCollector(queue))
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def queue_depths(queue: TaskQueue) -> dict[str, float]:
    (family,) = scrape(queue)
    assert family.name == "pagedbatch:queue_depth"
    return {sample.labels["queue"]: sample.value for sample in family.samples}


def test_in_process_depth_counts_tasks_waiting_for_a_thread_per_lane():
    release = threading.Event()
    started = threading.Semaphore(0)

    def run(name: str, args: tuple) -> None:
        started.release()
        release.wait(10)

    queue = InProcessQueue(run, lanes={"run_shard": 1}, max_workers=1)
    try:
        for _ in range(4):
            queue.enqueue("run_shard")
        queue.enqueue("validate_batch")
        queue.enqueue("validate_batch")
        assert started.acquire(timeout=5) and started.acquire(timeout=5)
        # Each pool's one thread runs a task; the others wait.
        assert queue_depths(queue) == {"default": 1, "run_shard": 3}
        release.set()
        for _ in range(4):
            assert started.acquire(timeout=5)
        assert queue_depths(queue) == {"default": 0, "run_shard": 0}
    finally:
        release.set()
        queue.shutdown()


def test_celery_depth_is_the_length_of_the_queue_in_redis(redis_url: str):
    app = make_celery(Settings(broker_url=redis_url), run=lambda name, args: None)
    queue = CeleryQueue(app)
    assert queue_depths(queue) == {QUEUE: 0}
    for _ in range(3):
        queue.enqueue("validate_batch", "batch_x")  # no worker takes them
    assert queue_depths(queue) == {QUEUE: 3}


def test_an_unreachable_broker_leaves_the_depth_out_rather_than_fail_the_scrape():
    app = make_celery(Settings(broker_url="redis://127.0.0.1:1/0"), run=lambda name, args: None)
    assert scrape(CeleryQueue(app)) == []


def test_a_worker_serves_its_engine_and_batch_metrics_on_its_own_port():
    server = serve_metrics("127.0.0.1", 0)
    try:
        response = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10)
    finally:
        server.shutdown()
    assert response.status_code == 200
    families = list(text_string_to_metric_families(response.text))
    names = {family.name for family in families}
    # Counters' families are named without `_total`.
    assert {f"{PREFIX}batch_requests", f"{PREFIX}generation_tokens"} <= names
    assert f"{PREFIX}num_requests_running" in names
    assert not [family for family in families if family.name.endswith("_created")]
