"""A structured-output grammar is held to its compile time through the doors: a schema whose
grammar compiles past `grammar_compile_seconds` is a 400 naming response_format, realtime and as
a batch line's error line, and another tenant's JSON-mode request is not held up meanwhile."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from servers import API_KEYS, BatchServer
from test_batches import chat_line, create, finished, read_lines

BUDGET = 0.5  # seconds; the costly schema takes seconds on any machine


def costly_format(seed: int) -> dict[str, Any]:
    """An enum of 1,200 strings of 300 characters: inside every size bound (0.4 MB of schema),
    about 3 s to compile on a 2-core machine."""
    rng = random.Random(seed)
    values = ["".join(rng.choice("abcdefghij klmnop") for _ in range(300)) for _ in range(1200)]
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": values}}}


def ask(client: openai.OpenAI, response_format: dict[str, Any]) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=16,
        response_format=response_format,
    )


def test_a_costly_schema_is_a_400_and_holds_up_no_other_tenant(serve_batches):
    server: BatchServer = serve_batches(api_keys=API_KEYS, grammar_compile_seconds=BUDGET)
    tenant_a, tenant_b = server.client(API_KEYS[0]), server.client(API_KEYS[1])
    with ThreadPoolExecutor(2) as pool:
        costly = [pool.submit(ask, tenant_a, costly_format(seed)) for seed in (1, 2)]
        time.sleep(0.3)  # A's compiles are under way
        started = time.monotonic()
        answer = ask(tenant_b, {"type": "json_object"})
        waited = time.monotonic() - started
        for future in costly:
            with pytest.raises(openai.BadRequestError) as caught:
                future.result(timeout=120)
            error = caught.value.body
            assert (error["param"], error["code"]) == (
                "response_format",
                "response_format_too_costly",
            )
            assert f"took more than {BUDGET:g} s to compile" in error["message"]
    assert answer.choices[0].message.content is not None
    # Generous on a shared machine: alone it takes well under a second; behind A's two
    # compiles on one thread it waited for both (6 s here, 39 s for the schemas).
    assert waited < 5


@pytest.mark.parametrize("storage", ["embedded"], indirect=True)
def test_a_batch_line_with_a_costly_schema_fails_alone_naming_response_format(serve_batches):
    server: BatchServer = serve_batches(grammar_compile_seconds=BUDGET)
    client = server.client()
    lines = [
        chat_line("costly", response_format=costly_format(3)),
        chat_line("json", response_format={"type": "json_object"}),
    ]
    batch = finished(client, create(client, lines).id)
    assert batch.status == "completed"
    (ok,) = read_lines(client, batch.output_file_id)
    assert ok["custom_id"] == "json" and ok["response"]["status_code"] == 200
    (error,) = read_lines(client, batch.error_file_id)
    assert error["custom_id"] == "costly"
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "response_format"
