"""Bounds on what a request may hold: every field, the body's bytes, an upload's form fields.

Whatever a client sends is an OpenAI-shaped 4xx naming what is wrong, never a 5xx; a body over
its limit is refused as it arrives, and a large one allowed in is prepared off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
from servers import BatchServer
from test_realtime import MESSAGES, chat_body, completion_body, stats

from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.serving.common import parse_request

MiB = 1 << 20


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def deep_schema(depth: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(depth)}}


def many_tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


# (endpoint, fields, the param the 400 names)
HOSTILE = {
    "top-k-beyond-64-bits": ("chat", {"top_k": 10**30}, "top_k"),
    "seed-beyond-int64": ("chat", {"seed": 2**64}, "seed"),
    "logit-bias-huge-key": (
        "chat",
        {"logit_bias": {"-100000000000000000000000": 1}},
        "logit_bias.-100000000000000000000000",
    ),
    "logit-bias-too-many": (
        "chat",
        {"logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
    ),
    "logit-bias-infinite": ("chat", {"logit_bias": {"5": float("inf")}}, "logit_bias.5"),
    "repetition-penalty-infinite": (
        "chat",
        {"repetition_penalty": float("inf")},
        "repetition_penalty",
    ),
    "presence-penalty-nan": ("chat", {"presence_penalty": float("nan")}, "presence_penalty"),
    "stop-too-long": ("chat", {"stop": ["x" * 257]}, "stop[0]"),
    "n": ("chat", {"n": 129}, "n"),
    "too-many-messages": ("chat", {"messages": MESSAGES * 1025}, "messages"),
    "too-many-tools": ("chat", {"tools": many_tools(129)}, "tools"),
    "schema-300-deep": ("chat", {"response_format": deep_schema(300)}, "response_format"),
    "schema-nan": (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "number", "minimum": float("nan")}},
            }
        },
        "response_format",
    ),
    "lone-surrogate": (
        "chat",
        {"messages": [{"role": "user", "content": "a\ud800"}]},
        "messages[0].content",
    ),
    "metadata-too-many": ("chat", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    "too-many-prompts": ("completion", {"prompt": ["a"] * 65}, "prompt"),
    "min-tokens-beyond-64-bits": ("completion", {"min_tokens": 10**20}, "min_tokens"),
}


def path_and_body(endpoint: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        return "/v1/chat/completions", chat_body(**fields)
    return "/v1/completions", completion_body(**fields)


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_each_bound_is_a_400_naming_the_field(case):
    endpoint, fields, param = case
    schema = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    _, body = path_and_body(endpoint, fields)
    with pytest.raises(OpenAIError) as caught:
        parse_request(schema, body)
    error = caught.value
    assert error.status_code == 400
    assert error.detail.param is not None and error.detail.param.startswith(param)


def test_hostile_values_are_400s_at_the_realtime_door_and_never_reach_the_engine(serve_batches):
    server: BatchServer = serve_batches()
    before = stats(server)
    with server.http() as http:
        for endpoint, fields, param in HOSTILE.values():
            path, body = path_and_body(endpoint, fields)
            # Python's encoder writes NaN and Infinity, as a careless client's would.
            response = http.post(path, content=json.dumps(body), headers=JSON)
            assert response.status_code == 400, (fields.keys(), response.text[:300])
            assert response.json()["error"]["param"].startswith(param)
        # Sane values that the engine's own limits would once have failed on.
        for fields in ({"top_k": 10**6, "top_p": 0.5}, {"seed": -(2**63)}):
            assert http.post("/v1/chat/completions", json=chat_body(**fields)).status_code == 200
    after = stats(server)
    assert after["finished_requests"] == before["finished_requests"] + 2


JSON = {"content-type": "application/json"}


def test_a_body_over_the_limit_is_a_413_before_it_is_read(serve_batches):
    server: BatchServer = serve_batches(max_request_body_bytes=MiB)
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (2 * MiB)}]))

    def chunked():  # no Content-Length: found too large as it streams in
        step = 64 << 10
        for start in range(0, len(big), step):
            yield big[start : start + step].encode()

    with server.http() as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
            for content in (big, chunked()):
                response = http.post(path, content=content, headers=JSON)
                assert response.status_code == 413, (path, response.text[:300])
                error = response.json()["error"]
                assert error["code"] == "request_too_large" and str(MiB) in error["message"]
                assert response.headers["x-request-id"].startswith("req_")
        assert http.get("/health").status_code == 200


def test_a_large_request_is_prepared_off_the_event_loop(serve_batches):
    # 1 MiB of messages: seconds of parsing, templating and tokenizing on two cores, then a 400
    # for a prompt beyond the context.
    server: BatchServer = serve_batches()
    messages = [{"role": "user", "content": "hello there " * 45_000} for _ in range(2)]
    body = json.dumps(chat_body(messages=messages))
    answered: list[httpx.Response] = []

    def send() -> None:
        with server.http() as http:
            answered.append(http.post("/v1/chat/completions", content=body, headers=JSON))

    sender = threading.Thread(target=send)
    sender.start()
    slowest = asyncio.run(slowest_health_check(server.url, sender))
    sender.join()
    assert answered[0].status_code == 400, answered[0].text[:300]
    assert answered[0].json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 0.5, f"/health took {slowest:.2f} s while the request was prepared"


async def slowest_health_check(url: str, sender: threading.Thread) -> float:
    """The longest `/health` took while `sender` runs, checked every 20 ms."""
    slowest = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while sender.is_alive():
            started = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.02)
    return slowest


def multipart(fields: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = "b0undary"
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        + value
        + b"\r\n"
        for name, value in fields
    )
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_an_upload_takes_a_bounded_number_of_form_fields(server):
    fields = [(f"junk{i}", b"v" * (60 << 10)) for i in range(200)]  # 12 MiB of fields
    body, content_type = multipart([("purpose", b"batch"), *fields])
    with server.http() as http:
        response = http.post("/v1/files", content=body, headers={"content-type": content_type})
    assert response.status_code == 400
    assert "Too many form fields" in response.json()["error"]["message"]


def test_an_upload_boundary_longer_than_the_rfc_allows_is_a_400(server):
    body, _ = multipart([("purpose", b"batch")])
    content_type = f"multipart/form-data; boundary={'x' * 10_000}"
    with server.http() as http:
        response = http.post("/v1/files", content=body, headers={"content-type": content_type})
    assert response.status_code == 400
    assert "boundary of 1 to 70 characters" in response.json()["error"]["message"]


def test_a_lone_surrogate_in_a_batch_is_a_400_naming_the_field(server):
    body = {
        "input_file_id": "file-\ud800",
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    with server.http() as http:
        response = http.post("/v1/batches", content=json.dumps(body), headers=JSON)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input_file_id"
