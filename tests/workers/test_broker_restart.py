"""A worker process rides out restarts of its Redis broker: the real `pagedbatch worker` on a
real `redis-server` that is killed and started again, empty, on the same port while the worker
runs a shard. The same process reconnects, goes on taking tasks, and every batch completes with
each line exactly once; once for a short outage, once for one longer than Celery's first
reconnect attempts.

The moment matters. Celery 5.7.0 (with kombu 5.7.0) died with `Unrecoverable error:
AttributeError("'NoneType' object has no attribute 'hostname'")` when the broker went away while
the worker held an unacknowledged task (acks_late: the running shard) and waited on BRPOP with a
free slot: its reconnect path closes the old connection twice, and the second close restores the
unacknowledged task through a connection pool rebuilt from a transport already detached. So each
batch here is one shard, running alone, when the broker dies (test_outages.py, where every slot
is busy, never hit it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from harness import RedisServer
from servers import (
    Deployment,
    chat_lines,
    eventually,
    output_ids,
    running_deployment,
    wait_for_batch,
)
from services import postgres_schema

from pagedbatch.settings import Settings
from pagedbatch.workers.celery_app import make_celery

LINES = 6
LONG_LINE_TOKENS = 1200  # the shard outlasts the moment the broker dies, on a fast machine too
SHORT_OUTAGE_SECONDS = 3.0
LONG_OUTAGE_SECONDS = 25.0  # past Celery's reconnect attempts at 2, 6, 12 and 20 s
RECONNECT_SECONDS = 60.0  # Celery retries at most every 30 s, whatever the outage's length


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def deployment(
    broker: RedisServer, tmp_path: Path, tiny_llama: Path, postgres_url: str, s3_settings_env: str
) -> Iterator[Deployment]:
    settings = {
        # A batch is one shard, and the worker runs one shard at a time: while it runs, the
        # worker's other task slots are free and it waits on the broker for more.
        "PAGEDBATCH_SHARD_SIZE": str(LINES),
        "PAGEDBATCH_WORKER_CONCURRENCY": "1",
        "PAGEDBATCH_UPKEEP_INTERVAL_SECONDS": "1",
        "PAGEDBATCH_REAPER_INTERVAL_SECONDS": "2",
        "PAGEDBATCH_WORKER_METRICS_PORT": "0",
    }
    with (
        postgres_schema(postgres_url) as database_url,
        running_deployment(tmp_path, tiny_llama, database_url, broker.url, settings) as deployment,
    ):
        yield deployment


def batch_lines() -> bytes:
    """`r0` ends at once (it shows the shard is running); the others run on for seconds."""
    return chat_lines(LINES, LONG_LINE_TOKENS, first_max_tokens=1)


def waiting_on_the_queue(broker: RedisServer) -> bool:
    """Whether a client of this broker is blocked on the task queue: a worker taking tasks."""
    try:
        clients = redis.Redis.from_url(broker.url, socket_timeout=2).client_list()
    except redis.ConnectionError:
        return False
    return any(client["cmd"] == "brpop" for client in clients)


@pytest.mark.slow  # about a minute and a half: two batches, outages of 3 and 25 s
def test_a_worker_process_rides_out_broker_restarts_and_goes_on_taking_tasks(deployment, broker):
    worker = deployment.start_worker("worker")
    client = deployment.client()
    eventually(lambda: waiting_on_the_queue(broker), timeout=RECONNECT_SECONDS)

    for down_seconds in (SHORT_OUTAGE_SECONDS, LONG_OUTAGE_SECONDS):
        # A new batch: its validation, shard and finalization are tasks from the broker, which
        # the worker must take after each restart as it did before.
        file_id = client.files.create(file=("in.jsonl", batch_lines()), purpose="batch").id
        batch_id = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        wait_for_batch(client, batch_id, lambda b: b.request_counts.completed >= 1)

        broker.kill()
        running = client.batches.retrieve(batch_id).request_counts.completed
        assert running < LINES, "the shard ended before the broker died; make the lines longer"
        time.sleep(down_seconds)
        broker.start()

        # The same process, back on the restarted (empty) broker.
        eventually(
            lambda: worker.poll() is not None or waiting_on_the_queue(broker),
            timeout=RECONNECT_SECONDS,
        )
        assert worker.poll() is None, deployment.log("worker")[-6000:]
        batch = wait_for_batch(client, batch_id, lambda b: b.status in {"completed", "failed"})
        assert batch.status == "completed", batch
        ids = output_ids(client, batch.output_file_id)
        assert sorted(ids) == sorted(f"r{i}" for i in range(LINES))  # each exactly once

    assert worker.poll() is None
    assert "Unrecoverable error" not in deployment.log("worker")


def test_a_worker_retries_the_broker_for_as_long_as_it_is_away(tmp_path: Path) -> None:
    # Celery's default gives up after 100 tries, about 50 minutes at its 30 s cap, and the
    # worker exits: an outage of any length must not end it.
    settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:9/0")
    conf = make_celery(settings, run=lambda name, args: None).conf
    assert conf.broker_connection_retry and conf.broker_connection_retry_on_startup
    assert conf.broker_connection_max_retries is None
