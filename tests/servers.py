"""The live servers API tests talk to: what a started server offers a test.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
Starting, waiting for and stopping processes is benchmarks/harness.py's, which the benchmarks
use too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from harness import free_port as free_port  # re-exported to the test modules
from harness import healthy, redis_database, start_process, stop_processes, wait_until
from harness import kill as kill  # re-exported to the test modules
from redis.asyncio import Redis as AsyncRedis
from services import postgres_schema

from pagedbatch.service import Embedded
from pagedbatch.settings import Settings
from pagedbatch.store.engine_registry import EngineRecord, live_engines

API_KEYS = ["k1", "k2"]
STORAGES = ["embedded", "distributed"]
START_SECONDS = 30.0


@dataclass
class Storage:
    kind: str  # "embedded" or "distributed"
    settings: dict[str, Any]
    blob_keys: Callable[[], list[str]]  # every key in blob storage, to see what was left behind


@dataclass
class Server:
    url: str
    settings: Settings
    blob_keys: Callable[[], list[str]]

    def client(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        # No retries: a test sees each response the server gave.
        options.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **options)

    def http(self, api_key: str | None = None) -> httpx.Client:
        """A plain HTTP client, for what the SDK cannot send or hides."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@dataclass
class BatchServer(Server):
    embedded: Embedded


# The distributed deployment as processes: an API and workers (`pagedbatch serve` and
# `pagedbatch worker`), each in a session of its own, so a test can kill one and its children.


@dataclass
class Deployment:
    url: str  # the API's
    env: dict[str, str]  # every process's environment
    tmp: Path  # logs go here, a file per process
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def start(self, name: str, *command: str, **env: str) -> subprocess.Popen[bytes]:
        """`pagedbatch <command>` with this deployment's environment and `env` on top."""
        argv = [sys.executable, "-m", "pagedbatch.cli", *command]
        process = start_process(argv, {**self.env, **env}, self.tmp / f"{name}.log")
        self.processes.append(process)
        return process

    def start_api(self) -> subprocess.Popen[bytes]:
        api = self.start("api", "serve")
        wait_for_health(self.url, api, self.tmp / "api.log")
        return api

    def start_worker(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        return self.start(name, "worker", **env)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_processes(self.processes)


@contextmanager
def running_deployment(
    tmp: Path, model: Path, database_url: str, broker_url: str, settings: dict[str, str]
) -> Iterator[Deployment]:
    """A deployment whose API is up on a free port, serving `model` as `tiny`, with `settings`
    (PAGEDBATCH_* and other variables) on top of the shared environment; on exit every process
    it started is stopped."""
    port = free_port()
    env = {
        **os.environ,
        "PAGEDBATCH_DATABASE_URL": database_url,
        "PAGEDBATCH_BROKER_URL": broker_url,
        "PAGEDBATCH_DATA_DIR": str(tmp / "data"),
        "PAGEDBATCH_MODEL": str(model),
        "PAGEDBATCH_SERVED_MODEL_NAME": "tiny",
        "PAGEDBATCH_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        **settings,
    }
    deployment = Deployment(f"http://127.0.0.1:{port}", env, tmp)
    try:
        deployment.start_api()
        yield deployment
    finally:
        deployment.stop()


@contextmanager
def distributed_deployment(
    tmp: Path, model: Path, postgres_url: str, settings: dict[str, str]
) -> Iterator[Deployment]:
    """`running_deployment` on a PostgreSQL schema and a Redis database of its own (its queue,
    its keys), the Redis database emptied before and after."""
    with (
        redis_database() as broker,
        postgres_schema(postgres_url) as database_url,
        running_deployment(tmp, model, database_url, broker, settings) as deployment,
    ):
        yield deployment


# A process loads a model and migrates the database first; in a fresh cache it builds the C
# kernels too (48 s in a CI run whose other worker held both cores and 7.9 GB).
PROCESS_START_SECONDS = 180


def wait_for_health(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    wait_until(lambda: healthy(url), process, f"the server at {url}", log, PROCESS_START_SECONDS)


def chat_lines(n: int, max_tokens: int, first_max_tokens: int | None = None) -> bytes:
    """A batch input file of `n` chat lines, `r0`..., each generating `max_tokens` tokens (`r0`
    `first_max_tokens`, where given: a line that ends at once shows the batch is running)."""
    return "\n".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "max_tokens": max_tokens if i or first_max_tokens is None else first_max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Question {i}"}],
                },
            }
        )
        for i in range(n)
    ).encode()


def wait_for_batch(
    client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout: float = 180.0
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} stuck in {batch.status}: {batch}")


def output_ids(client: openai.OpenAI, file_id: str) -> list[str]:
    text = client.files.content(file_id).text
    return [json.loads(line)["custom_id"] for line in text.splitlines()]


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Waits for `condition` to hold, failing the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not so after {timeout} s"
        time.sleep(0.02)


def engine_records(broker: str) -> list[EngineRecord]:
    """The live engine hosts registered in the Redis at `broker`."""

    async def read() -> list[EngineRecord]:
        client = AsyncRedis.from_url(broker)
        try:
            return await live_engines(client)
        finally:
            await client.aclose()

    return asyncio.run(read())
