"""The distributed deployment as it runs in production: an API process and separate worker
processes (Celery on the real Redis), PostgreSQL and the S3 server. A worker killed mid-batch
loses nothing and duplicates nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from servers import (
    PROCESS_START_SECONDS,
    Deployment,
    chat_lines,
    distributed_deployment,
    engine_records,
    eventually,
    kill,
    output_ids,
    wait_for_batch,
)
from webhook_receiver import Receiver

RESPONSE_TOKENS = 600  # the background response outlasts the moment its worker is killed


@pytest.fixture
def deployment(tmp_path, tiny_llama, postgres_url, s3_settings_env) -> Iterator[Deployment]:
    settings = {
        "PAGEDBATCH_SHARD_SIZE": "3",
        "PAGEDBATCH_LEASE_SECONDS": "3",
        "PAGEDBATCH_REAPER_INTERVAL_SECONDS": "1",
        "PAGEDBATCH_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
        "PAGEDBATCH_WEBHOOK_INITIAL_BACKOFF_SECONDS": "0.3",
    }
    with distributed_deployment(tmp_path, tiny_llama, postgres_url, settings) as deployment:
        yield deployment


def test_a_worker_process_runs_batches_from_the_api(deployment):
    deployment.start_worker("worker")
    client = deployment.client()
    file_id = client.files.create(file=("in.jsonl", chat_lines(7, 6)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status in {"completed", "failed"})
    assert batch.status == "completed", batch
    assert sorted(output_ids(client, batch.output_file_id)) == sorted(f"r{i}" for i in range(7))
    assert batch.error_file_id is None


def test_a_worker_delivers_the_batch_webhook_retrying_through_celery(deployment):
    deployment.start_worker("worker")
    client = deployment.client()
    with Receiver(statuses=[500]) as receiver:
        endpoint = httpx.post(
            f"{deployment.url}/v1/webhook_endpoints", json={"url": receiver.url()}
        ).json()
        file_id = client.files.create(file=("in.jsonl", chat_lines(2, 4)), purpose="batch").id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        received = receiver.wait_for(lambda got: [r.status for r in got] == [500, 200], 120)
    assert received[0].headers["webhook-id"] == received[1].headers["webhook-id"]
    event = client.webhooks.unwrap(received[1].body, received[1].headers, secret=endpoint["secret"])
    assert (event.type, event.data.id) == ("batch.completed", batch.id)


def test_killing_a_worker_mid_batch_loses_and_duplicates_nothing(deployment):
    first = deployment.start_worker("first")
    client = deployment.client()
    file_id = client.files.create(file=("in.jsonl", chat_lines(30, 48)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for_batch(client, batch.id, lambda b: b.request_counts.completed >= 3)
    kill(first)
    killed_at = client.batches.retrieve(batch.id).request_counts.completed
    assert killed_at < 30, "the batch finished before the kill; make it longer"

    deployment.start_worker("second")
    batch = wait_for_batch(client, batch.id, lambda b: b.status in {"completed", "failed"})
    assert batch.status == "completed", batch
    ids = output_ids(client, batch.output_file_id)
    assert sorted(ids) == sorted(f"r{i}" for i in range(30))  # each exactly once
    assert batch.request_counts.completed == 30 and batch.request_counts.failed == 0


def test_killing_a_worker_mid_background_response_loses_nothing(deployment):
    workers = {name: deployment.start_worker(name) for name in ("one", "two")}
    client = deployment.client()
    broker = deployment.env["PAGEDBATCH_BROKER_URL"]
    # The API forwards a background create to an engine host, which saves and queues it.
    eventually(lambda: len(engine_records(broker)) == 2, timeout=PROCESS_START_SECONDS)
    created = client.responses.create(
        background=True, model="tiny", input="Go on.", max_output_tokens=RESPONSE_TOKENS
    )
    assert created.status == "queued"

    def running_on(attempt: int) -> list[str]:
        line = f"running background response {created.id} (attempt {attempt})"
        return [name for name in workers if line in deployment.log(name)]

    eventually(lambda: running_on(1), timeout=30)
    [runner] = running_on(1)
    kill(workers[runner])
    assert client.responses.retrieve(created.id).status == "in_progress", "make it longer"

    eventually(
        lambda: client.responses.retrieve(created.id).status not in ("queued", "in_progress"),
        timeout=120,
    )
    done = client.responses.retrieve(created.id)
    assert done.status == "incomplete" and done.usage.output_tokens == RESPONSE_TOKENS
    assert running_on(2) == [name for name in workers if name != runner]  # taken over
