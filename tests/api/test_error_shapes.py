"""One rule for client errors (docs/api.md): every 4xx has a `code`, and `param` names what
the client sent wrong wherever one parameter is; a body or line nested too deeply says so; an
unknown `after` cursor is the same 400 naming `after` in every list."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servers import wait_for_batch

from pagedbatch.protocol.errors import OpenAIError

COMPLETION = {"model": "tiny", "max_tokens": 2}


def error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_every_client_error_has_a_code():
    assert OpenAIError("bad").detail.code == "invalid_request"
    assert OpenAIError("bad", param="n").detail.code == "invalid_value"
    assert OpenAIError("gone", status_code=404, code="not_found").detail.code == "not_found"
    assert OpenAIError("ours", status_code=500, type="server_error").detail.code is None


def test_an_empty_prompt_is_a_400_naming_it(serve_batches):
    server = serve_batches()
    with server.http() as http:
        alone = error(http.post("/v1/completions", json={**COMPLETION, "prompt": ""}))
        among = error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["Hi", ""]}))
    assert (alone["param"], alone["code"]) == ("prompt", "invalid_value")
    assert "empty" in alone["message"]
    assert (among["param"], among["code"]) == ("prompt[1]", "invalid_value")


def test_a_batch_line_nested_too_deeply_says_so(serve_batches):
    client = serve_batches().client()
    body = {**COMPLETION, "prompt": "Hi"}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body})
    deep = line[:-2] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}}"
    upload = client.files.create(file=("in.jsonl", deep.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status != "validating")
    assert batch.status == "failed"
    [problem] = batch.errors.data
    assert (problem.code, problem.line) == ("invalid_json_line", 1)
    assert "nests more than 500 levels deep" in problem.message


def test_a_body_nested_too_deeply_says_so(serve_batches):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with serve_batches().http() as http:
        response = http.post(
            "/v1/completions", content=deep, headers={"content-type": "application/json"}
        )
    refused = error(response)
    assert refused["code"] == "invalid_json"
    assert "nests more than 500 levels deep" in refused["message"]


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/files", "/v1/webhook_endpoints"])
def test_an_unknown_after_cursor_is_a_400_naming_after_in_every_list(server, path):
    with server.http() as http:
        refused = error(http.get(path, params={"after": "nothing-of-mine"}))
    assert (refused["param"], refused["code"]) == ("after", "invalid_value")
    assert "nothing-of-mine" in refused["message"]


def test_the_sdk_raises_a_bad_request_for_an_unknown_batch_cursor(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().batches.list(after="batch_unknown")
    assert caught.value.param == "after"
