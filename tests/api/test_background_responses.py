"""Background responses through the unmodified `openai` SDK against the embedded service: created
`queued` at once, retrieved until they end as the same request in the foreground would, cancelled
(their engine requests aborted), announced by `response.*` webhooks that `webhooks.unwrap`
verifies, and refused at once when the request is bad."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
from servers import API_KEYS, BatchServer, eventually
from webhook_receiver import Receiver

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 16}
# A strict format the tiny model ends in a few tokens, so that its response is `completed`
# (unformatted, it never stops before max_output_tokens).
YES_OR_NO = {
    "format": {
        "type": "json_schema",
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"yes": {"type": "boolean"}},
            "required": ["yes"],
            "additionalProperties": False,
        },
    }
}
LONG = 1500  # output tokens: many seconds on the tiny model
FAST_WEBHOOKS = {
    "webhook_allowed_hosts": ["127.0.0.1"],
    "webhook_initial_backoff_seconds": 0.2,
    "webhook_max_backoff_seconds": 0.4,
}


def register(server: BatchServer, url: str, api_key: str = "unused", **body: Any) -> dict:
    with server.http(api_key) as http:
        response = http.post("/v1/webhook_endpoints", json={"url": url, **body})
    assert response.status_code == 200, response.text
    return response.json()


def ended(client: openai.OpenAI, response_id: str, timeout: float = 60.0) -> Any:
    """The response once it has left `queued` and `in_progress`, polled as a client would."""
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.1)
    return response


def engine_holds(server: BatchServer, api_key: str = "unused") -> int:
    with server.http(api_key) as http:
        [engine] = http.get("/v1/engine/stats").json()["engines"]
    return engine["running"] + engine["waiting"]


def test_a_background_response_is_queued_then_ends_as_in_the_foreground_announced(
    serve_batches,
):
    server = serve_batches(**FAST_WEBHOOKS)
    client = server.client()
    with Receiver() as receiver:
        endpoint = register(server, receiver.url(), events=["response.completed"])
        created = client.responses.create(
            background=True, input="Yes or no?", instructions="Be brief.", text=YES_OR_NO, **GREEDY
        )
        assert (created.status, created.background, created.output) == ("queued", True, [])
        done = ended(client, created.id)
        [delivered] = receiver.wait_for(lambda got: len(got) == 1)

    assert done.status == "completed" and done.error is None
    foreground = client.responses.create(
        input="Yes or no?", instructions="Be brief.", text=YES_OR_NO, **GREEDY
    )
    assert done.output_text == foreground.output_text
    json.loads(done.output_text)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        foreground.usage.input_tokens,
        foreground.usage.output_tokens,
    )
    assert [item.role for item in client.responses.input_items.list(created.id)] == ["user"]

    event = client.webhooks.unwrap(delivered.body, delivered.headers, secret=endpoint["secret"])
    assert (event.type, event.data.id, event.object) == ("response.completed", created.id, "event")
    assert json.loads(delivered.body) == {
        "id": event.id,
        "object": "event",
        "type": "response.completed",
        "created_at": event.created_at,
        "data": {"id": created.id},
    }
    assert event.id.startswith("evt_") and delivered.headers["webhook-id"].startswith("wh_")
    with server.http() as http:
        [log] = http.get(f"/v1/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]
    assert (log["event_type"], log["response_id"], log["batch_id"]) == (
        "response.completed",
        created.id,
        None,
    )


def test_cancel_stops_a_background_response_and_aborts_its_engine_requests(serve_batches):
    server = serve_batches(api_keys=API_KEYS, **FAST_WEBHOOKS)
    mine, theirs = server.client(API_KEYS[0]), server.client(API_KEYS[1])
    with Receiver() as receiver:
        endpoint = register(server, receiver.url(), API_KEYS[0])
        running = mine.responses.create(
            background=True, input="Go on.", model="tiny", max_output_tokens=LONG
        )
        eventually(lambda: engine_holds(server, API_KEYS[0]) == 1, timeout=10)
        with pytest.raises(openai.NotFoundError):  # another tenant's is not there for them
            theirs.responses.cancel(running.id)

        cancelled = mine.responses.cancel(running.id)
        assert (cancelled.id, cancelled.status) == (running.id, "cancelled")
        eventually(lambda: engine_holds(server, API_KEYS[0]) == 0, timeout=2)
        [delivered] = receiver.wait_for(lambda got: len(got) == 1)

    event = mine.webhooks.unwrap(delivered.body, delivered.headers, secret=endpoint["secret"])
    assert (event.type, event.data.id) == ("response.cancelled", running.id)
    time.sleep(1)  # its worker has stopped: it stays cancelled, with no output
    assert mine.responses.retrieve(running.id).status == "cancelled"
    assert mine.responses.retrieve(running.id).output == []
    assert mine.responses.cancel(running.id).status == "cancelled"  # again: unchanged

    # One that has ended is answered as it is.
    finished = mine.responses.create(background=True, input="Yes?", text=YES_OR_NO, **GREEDY)
    finished = ended(mine, finished.id)
    assert mine.responses.cancel(finished.id) == finished
    # Only background responses can be cancelled.
    foreground = mine.responses.create(input="Hi", **GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        mine.responses.cancel(foreground.id)
    assert refused.value.body["message"] == (
        "Only responses created with background can be cancelled."
    )
    assert mine.responses.retrieve(foreground.id).status == "incomplete"


# Each bad background request, the error it gets at once, and the field it names.
BAD = [
    ({"store": False}, openai.BadRequestError, "store"),
    ({"stream": True}, openai.BadRequestError, "stream"),
    ({"temperature": 3}, openai.BadRequestError, "temperature"),
    ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools[0]"),
    ({"model": "nope"}, openai.NotFoundError, "model"),
    ({"previous_response_id": "resp_nope"}, openai.NotFoundError, "previous_response_id"),
]


def test_a_bad_background_request_is_refused_at_once_and_nothing_is_queued(serve_batches):
    server = serve_batches()
    client = server.client()
    for fault, error, param in BAD:
        body = {**GREEDY, "input": "Hi", "background": True, **fault}
        with pytest.raises(error) as refused:
            client.responses.create(**body)
        assert refused.value.body["param"] == param, (fault, refused.value.body)
    assert engine_holds(server) == 0
    assert server.embedded.queue.depths()["run_response"] == 0
