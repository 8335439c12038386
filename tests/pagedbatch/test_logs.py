"""Log lines: the JSON format, and `pagedbatch serve --log-format json` writing it, request ids
included, for its own lines and the server's."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

from pagedbatch.logs import JsonFormatter, request_id
from pagedbatch.settings import Settings


def record(message: str = "shard %s done", exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord(
        "pagedbatch.workers.batches.shards", logging.INFO, __file__, 1, message, ("s1",), exc_info
    )


def test_a_json_line_has_time_level_logger_and_message():
    line = json.loads(JsonFormatter().format(record()))
    assert set(line) == {"time", "level", "logger", "message"}
    assert line["level"] == "INFO"
    assert line["logger"] == "pagedbatch.workers.batches.shards"
    assert line["message"] == "shard s1 done"
    assert line["time"].endswith("+00:00")  # ISO 8601, UTC
    assert abs(time.time() - datetime.fromisoformat(line["time"]).timestamp()) < 60


def test_inside_a_request_the_line_carries_its_id():
    def in_request() -> str:
        request_id.set("req_abc")
        return JsonFormatter().format(record())

    assert json.loads(contextvars.copy_context().run(in_request))["request_id"] == "req_abc"
    assert "request_id" not in json.loads(JsonFormatter().format(record()))


def test_an_exception_goes_into_the_line():
    try:
        raise ValueError("bad shard")
    except ValueError:
        failed = record("shard %s failed", exc_info=sys.exc_info())
    line = json.loads(JsonFormatter().format(failed))
    assert line["message"] == "shard s1 failed"
    assert "ValueError: bad shard" in line["exception"]


def test_the_format_is_a_setting_text_by_default(monkeypatch):
    assert Settings().log_format == "text"
    monkeypatch.setenv("PAGEDBATCH_LOG_FORMAT", "json")
    assert Settings().log_format == "json"


def test_serve_writes_json_lines_with_request_ids(tmp_path: Path, tiny_llama: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pagedbatch.cli", "serve", "--log-format", "json",
             "--model", str(tiny_llama), "--port", str(port), "--data-dir", str(tmp_path)],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        response = httpx.get(f"{url}/v1/models", headers={"x-request-id": "trace-42"})
        assert response.status_code == 200
        # Ours, not the client's: a client's id could pass for another request's.
        ours = response.headers["x-request-id"]
        assert ours.startswith("req_")
    finally:
        server.terminate()
        server.wait(30)

    lines = [json.loads(text) for text in log_path.read_text().splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    [access] = [line for line in lines if "/v1/models" in line["message"]]
    assert access["logger"] == "uvicorn.access"
    assert access["request_id"] == ours
    # The client's id is logged beside ours, so a report quoting it leads to our lines.
    [client] = [line for line in lines if "trace-42" in line["message"]]
    assert client["request_id"] == ours and client["level"] == "INFO"
    started = [line for line in lines if line["logger"] == "uvicorn.error"]
    assert started and all("request_id" not in line for line in started)
