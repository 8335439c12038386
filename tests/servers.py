"""The live servers API tests talk to: what a started server offers a test.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from pagedbatch.service import Embedded
from pagedbatch.settings import Settings

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        with (self.tmp / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pagedbatch.cli", *command],
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def kill(process: subprocess.Popen[bytes]) -> None:
    """`kill -9` of a process started by Deployment.start, and of its children."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


PROCESS_START_SECONDS = 60  # a process loads a model and migrates the database first


def wait_for_health(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + PROCESS_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"no answer in {PROCESS_START_SECONDS} s:\n{log.read_text()}")


def chat_lines(n: int, max_tokens: int) -> bytes:
    """A batch input file of `n` chat lines, `r0`..., each generating `max_tokens` tokens."""
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
