"""The distributed deployment as it runs in production: an API process and separate worker
processes (Celery on the real Redis), PostgreSQL and the S3 server. A worker killed mid-batch
loses nothing and duplicates nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from services import postgres_schema
from webhook_receiver import Receiver

REDIS = "redis://127.0.0.1:6379"
START_SECONDS = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Deployment:
    url: str
    env: dict[str, str]
    tmp: Path
    processes: list[subprocess.Popen]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def start_worker(self, name: str) -> subprocess.Popen:
        log = (self.tmp / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedbatch.cli", "worker", "--beat"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process


@pytest.fixture
def deployment(tmp_path, tiny_llama, postgres_url, s3_settings_env) -> Iterator[Deployment]:
    db_index = random.randrange(1, 16)  # a Redis database of our own: its queue, its keys
    broker = f"{REDIS}/{db_index}"
    redis.Redis.from_url(broker).flushdb()
    with postgres_schema(postgres_url) as database_url:
        port = free_port()
        env = {
            **os.environ,
            "PAGEDBATCH_DATABASE_URL": database_url,
            "PAGEDBATCH_BROKER_URL": broker,
            "PAGEDBATCH_DATA_DIR": str(tmp_path / "data"),
            "PAGEDBATCH_MODEL": str(tiny_llama),
            "PAGEDBATCH_SERVED_MODEL_NAME": "tiny",
            "PAGEDBATCH_PORT": str(port),
            "PAGEDBATCH_SHARD_SIZE": "3",
            "PAGEDBATCH_LEASE_SECONDS": "3",
            "PAGEDBATCH_REAPER_INTERVAL_SECONDS": "1",
            "PAGEDBATCH_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
            "PAGEDBATCH_WEBHOOK_INITIAL_BACKOFF_SECONDS": "0.3",
            "OMP_NUM_THREADS": "1",
        }
        deployment = Deployment(f"http://127.0.0.1:{port}", env, tmp_path, [])
        log = (tmp_path / "api.log").open("wb")
        api = subprocess.Popen(
            [sys.executable, "-m", "pagedbatch.cli", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deployment.processes.append(api)
        try:
            wait_for_health(deployment.url, api, tmp_path / "api.log")
            yield deployment
        finally:
            for process in deployment.processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
            for process in deployment.processes:
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
            redis.Redis.from_url(broker).flushdb()


def wait_for_health(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"no answer in {START_SECONDS} s:\n{log.read_text()}")


def lines(n: int, max_tokens: int) -> bytes:
    return "\n".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Question {i}"}],
                },
            }
        )
        for i in range(n)
    ).encode()


def wait_for(client, batch_id, done, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch stuck: {batch}")


def output_ids(client, file_id) -> list[str]:
    text = client.files.content(file_id).text
    return [json.loads(line)["custom_id"] for line in text.splitlines()]


def test_a_worker_process_runs_batches_from_the_api(deployment):
    deployment.start_worker("worker")
    client = deployment.client()
    file_id = client.files.create(file=("in.jsonl", lines(7, 6)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"})
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
        file_id = client.files.create(file=("in.jsonl", lines(2, 4)), purpose="batch").id
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
    file_id = client.files.create(file=("in.jsonl", lines(30, 48)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 3)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = client.batches.retrieve(batch.id).request_counts.completed
    assert killed_at < 30, "the batch finished before the kill; make it longer"

    deployment.start_worker("second")
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"})
    assert batch.status == "completed", batch
    ids = output_ids(client, batch.output_file_id)
    assert sorted(ids) == sorted(f"r{i}" for i in range(30))  # each exactly once
    assert batch.request_counts.completed == 30 and batch.request_counts.failed == 0
