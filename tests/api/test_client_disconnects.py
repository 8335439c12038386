"""Clients that leave before their body was read: each is one INFO line, never an ERROR nor a
traceback (a crowd of them would bury real errors), and leaves nothing behind."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from servers import eventually

FORM_START = (
    b"--b\r\n"
    b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    b"--b\r\n"
    b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    b'{"custom_id": "a"'
)
# What each client sends of its body before it leaves: a start of what the route takes.
ROUTES = {
    "/v1/chat/completions": ("application/json", b'{"model": "tiny", "messages": [{"role": '),
    "/v1/completions": ("application/json", b'{"model": "tiny", "prompt": "Once upon'),
    "/v1/batches": ("application/json", b'{"input_file_id": "file-'),
    "/v1/files": ("multipart/form-data; boundary=b", FORM_START),
}
CLIENTS_PER_ROUTE = 25


def leave_mid_body(url: str, path: str, content_type: str, start: bytes) -> None:
    """Sends the headers of a 1 MB body and its first bytes, then closes the connection."""
    address = httpx.URL(url)
    with socket.create_connection((address.host, address.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {1 << 20}\r\n\r\n".encode()
            + start
        )
        time.sleep(0.01)  # the server starts on the request before the client goes


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog`, with uvicorn's records too (its loggers do not propagate to the root's)."""
    caplog.set_level(logging.INFO)
    server_logger = logging.getLogger("uvicorn")
    server_logger.addHandler(caplog.handler)
    yield caplog
    server_logger.removeHandler(caplog.handler)


def test_clients_leaving_before_their_body_was_read_log_no_error(serve_batches, logs):
    server = serve_batches()
    for path, (content_type, start) in ROUTES.items():
        for _ in range(CLIENTS_PER_ROUTE):
            leave_mid_body(server.url, path, content_type, start)

    def left() -> list[logging.LogRecord]:
        return [
            r for r in logs.records if "disconnected before its body was read" in r.getMessage()
        ]

    eventually(lambda: len(left()) == CLIENTS_PER_ROUTE * len(ROUTES), timeout=60)
    assert {r.levelno for r in left()} == {logging.INFO}
    loud = [f"{r.name}: {r.getMessage()}" for r in logs.records if r.levelno >= logging.WARNING]
    assert loud == []
    assert [r for r in logs.records if r.exc_info] == []
    client = server.client()
    assert list(client.files.list()) == [] and list(client.batches.list()) == []
    assert server.blob_keys() == []
