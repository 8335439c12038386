"""Real servers for the API tests: uvicorn on a free port, spoken to with the official SDK.

`storage` picks where a server keeps its state: "embedded" (SQLite and a local directory, the
default) or "distributed" (a PostgreSQL schema and an S3 bucket); a module runs its tests on
both with `pytest.mark.parametrize("storage", STORAGES, indirect=True)`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from playwright.sync_api import Browser, sync_playwright
from servers import API_KEYS, START_SECONDS, BatchServer, Server, Storage
from services import S3Server, postgres_schema

from pagedbatch.api.app import create_app
from pagedbatch.api.deps import Services
from pagedbatch.engine import EngineArgs, LLMEngine
from pagedbatch.service import embedded
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import make_blob_store
from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.migrate import upgrade


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    """An engine on the tiny checkpoint, for serving tests that step it themselves."""
    return LLMEngine(EngineArgs(model=str(tiny_llama), max_num_seqs=8, num_kv_blocks=256))


@pytest.fixture
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    kind = getattr(request, "param", "embedded")
    if kind == "embedded":
        blob_root = tmp_path / "data" / "files"
        yield Storage(
            kind,
            {
                "data_dir": tmp_path / "data",
                "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
                "s3_bucket": None,
            },
            lambda: sorted(
                str(path.relative_to(blob_root)) for path in blob_root.rglob("*") if path.is_file()
            ),
        )
        return
    bucket: str = request.getfixturevalue("s3_settings_env")
    s3: S3Server = request.getfixturevalue("s3_server")
    with postgres_schema(request.getfixturevalue("postgres_url")) as database_url:
        yield Storage(
            kind,
            {
                "data_dir": tmp_path / "data",
                "database_url": database_url,
                "s3_endpoint_url": s3.endpoint_url,
                "s3_bucket": bucket,
            },
            lambda: sorted(
                item["Key"]
                for item in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
            ),
        )


def build_app(settings: Settings, served_models: list[str]) -> FastAPI:
    upgrade(settings.resolved_database_url)
    services = Services(
        settings=settings,
        session_factory=make_session_factory(make_engine(settings.resolved_database_url)),
        blobs=make_blob_store(settings),
        served_models=served_models,
    )
    return create_app(settings, services)


@contextmanager
def running(app: FastAPI, send_buffer_bytes: int | None = None) -> Iterator[str]:
    """`app` served by uvicorn in a thread of this process; yields its base URL.

    `send_buffer_bytes` fixes the kernel's send buffer of each connection (else it grows to
    megabytes), so that a client that stops reading soon holds up the server's sends.
    """
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    sock = socket.socket()
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)  # inherited
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = sock.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_SECONDS)
        sock.close()


Serve = Callable[..., Server]


@pytest.fixture
def serve(storage: Storage) -> Iterator[Serve]:
    """`serve(served_models=[], customize=None, **settings)`: a started server on `storage`.

    `customize(app)` runs before the server starts, e.g. to add a route.
    """
    with ExitStack() as stack:

        def start(
            served_models: list[str] | None = None,
            customize: Callable[[FastAPI], None] | None = None,
            **settings: Any,
        ) -> Server:
            config = Settings(**{**storage.settings, **settings})
            app = build_app(config, served_models or [])
            if customize is not None:
                customize(app)
            return Server(stack.enter_context(running(app)), config, storage.blob_keys)

        yield start


@pytest.fixture
def server(serve: Serve) -> Server:
    """A server without API keys: every client is the default tenant."""
    return serve()


@pytest.fixture
def auth_server(serve: Serve) -> Server:
    """A server that requires one of API_KEYS."""
    return serve(api_keys=API_KEYS)


# Kept to the imports the server needs, so that its memory is the server's own. Its settings come
# from the environment.
_SERVER_PROCESS = """
import sys

import uvicorn

from pagedbatch.api.app import create_app
from pagedbatch.api.deps import Services
from pagedbatch.settings import Settings
from pagedbatch.store.blobs import make_blob_store
from pagedbatch.store.db import make_engine, make_session_factory

settings = Settings()
services = Services(
    settings=settings,
    session_factory=make_session_factory(make_engine(settings.resolved_database_url)),
    blobs=make_blob_store(settings),
)
uvicorn.run(create_app(settings, services), host="127.0.0.1", port=settings.port,
            log_level="warning")
"""


@dataclass
class ServerProcess:
    server: Server
    pid: int


@pytest.fixture
def server_process(storage: Storage, tmp_path: Path) -> Iterator[ServerProcess]:
    """A server in a process of its own, so that its memory can be measured."""
    settings = Settings(**storage.settings, port=_free_port())
    upgrade(settings.resolved_database_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    for name, value in storage.settings.items():
        if value is not None:
            env[f"PAGEDBATCH_{name.upper()}"] = str(value)
    env["PAGEDBATCH_PORT"] = str(settings.port)
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVER_PROCESS], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{settings.port}"
    try:
        _wait_for_health(url, process, log_path)
        yield ServerProcess(Server(url, settings, storage.blob_keys), process.pid)
    finally:
        process.terminate()
        process.wait(START_SECONDS)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_health(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"the server did not answer in {START_SECONDS} s:\n{log.read_text()}")


@pytest.fixture
def serve_batches(storage: Storage, tiny_llama: Path) -> Iterator[Callable[..., BatchServer]]:
    """`serve_batches(send_buffer_bytes=None, **settings)`: the whole embedded service (API,
    task queue and an engine on the tiny checkpoint, served as "tiny") on `storage`. Small shards
    and short leases, so that tests see several shards and quick recovery."""
    with ExitStack() as stack:

        def start(send_buffer_bytes: int | None = None, **settings: Any) -> BatchServer:
            defaults = {
                "model": str(tiny_llama),
                "served_model_name": "tiny",
                "shard_size": 4,
                "lease_seconds": 3.0,
                "reaper_interval_seconds": 0.5,
            }
            config = Settings(**{**storage.settings, **defaults, **settings})
            service = embedded(config)
            stack.callback(service.shutdown)
            url = stack.enter_context(running(service.app, send_buffer_bytes))
            return BatchServer(url, config, storage.blob_keys, service)

        yield start


CHROMIUM = "/usr/bin/chromium"
# Debian's chromium, never a downloaded one: headless as root, and no background traffic into
# the closed network.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Debian's headless chromium through Playwright; the test is skipped where it is not
    installed. Playwright gives each launch a fresh profile directory of its own."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run does")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()
