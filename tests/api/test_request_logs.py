"""Log lines written while a request is served carry its id, the one its client sees in the
`x-request-id` header, in the JSON log format: a 500's lines included."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI

from pagedbatch.logs import JsonFormatter

logger = logging.getLogger("pagedbatch.tests.request_logs")


@pytest.fixture
def logged() -> Iterator[Callable[[], list[dict]]]:
    """`logged()`: the JSON lines logged (at INFO and above) so far in the test, parsed."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(text) for text in stream.getvalue().splitlines()]
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def add_routes(app: FastAPI) -> None:
    def work() -> dict[str, str]:
        logger.info("working")
        return {"ok": "yes"}

    def crash() -> None:
        raise RuntimeError("boom")

    app.add_api_route("/test/work", work)
    app.add_api_route("/test/crash", crash)


def test_lines_inside_a_request_carry_its_id(serve, logged):
    server = serve(customize=add_routes)
    with server.http() as http:
        sent = http.get("/test/work", headers={"x-request-id": "trace-7"})
        made = http.get("/test/work")
    logger.info("outside")
    ours = sent.headers["x-request-id"]
    assert ours.startswith("req_")  # the client's own id is not taken (api/app.py)
    lines = logged()
    working = [line for line in lines if line["message"] == "working"]
    assert [line["request_id"] for line in working] == [ours, made.headers["x-request-id"]]
    [theirs] = [line for line in lines if "trace-7" in line["message"]]
    assert theirs["request_id"] == ours
    [outside] = [line for line in lines if line["message"] == "outside"]
    assert "request_id" not in outside


def test_a_server_error_is_logged_with_the_id_its_client_got(serve, logged):
    server = serve(customize=add_routes)
    with server.http() as http:
        response = http.get("/test/crash")
    assert response.status_code == 500
    [failed] = [line for line in logged() if line["logger"] == "pagedbatch.api.app"]
    assert failed["level"] == "ERROR"
    assert failed["request_id"] == response.headers["x-request-id"]
