"""Batch webhooks end to end: the whole embedded service runs real batches to each final state,
and a real receiver gets each event, verified with the `openai` SDK's `webhooks.unwrap`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import openai
import pytest
from servers import STORAGES, BatchServer, Server
from webhook_receiver import Receiver

# Short backoffs and sweeps, so that retries take a fraction of a second.
FAST_WEBHOOKS = {
    "webhook_allowed_hosts": ["127.0.0.1"],
    "webhook_initial_backoff_seconds": 0.2,
    "webhook_max_backoff_seconds": 0.4,
    "webhook_max_attempts": 50,
}


def line(custom_id: str, max_tokens: int = 2, **body) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": max_tokens,
                **body,
            },
        }
    )


def start_batch(client: openai.OpenAI, lines: list[str]) -> str:
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def long_lines(count: int, max_tokens: int = 300) -> list[str]:
    return [line(f"r{i}", max_tokens=max_tokens, ignore_eos=True) for i in range(count)]


def register(server: Server, url: str, api_key: str = "unused", **body) -> dict:
    response = server.http(api_key).post("/v1/webhook_endpoints", json={"url": url, **body})
    assert response.status_code == 200, response.text
    return response.json()


def deliveries(server: Server, endpoint_id: str, api_key: str = "unused") -> list[dict]:
    """The endpoint's delivery log, oldest attempt first."""
    page = server.http(api_key).get(
        f"/v1/webhook_endpoints/{endpoint_id}/deliveries", params={"limit": 100}
    )
    return page.json()["data"][::-1]


def wait_for(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_every_final_state_reaches_the_receiver_signed(serve_batches):
    server: BatchServer = serve_batches(completion_window_seconds=6, shard_size=2, **FAST_WEBHOOKS)
    client = server.client()
    with Receiver() as receiver:
        everything = register(server, receiver.url("/all"))
        failures = register(server, receiver.url("/failed"), events=["batch.failed"])

        batches = {
            "batch.completed": start_batch(client, [line("a")]),
            "batch.failed": start_batch(client, ["this is not JSON"]),
            "batch.cancelled": start_batch(client, long_lines(4)),
        }
        client.batches.cancel(batches["batch.cancelled"])
        receiver.wait_for(lambda got: len(got) == 4)
        # Alone, so that it is the only batch to outlive the short completion window: 45,000
        # tokens, well past what a CPU runs the tiny model through in it (a Zen 5 EPYC finished
        # 9,000 within it).
        batches["batch.expired"] = start_batch(client, long_lines(30, max_tokens=1500))
        receiver.wait_for(lambda got: len(got) == 5)
        time.sleep(0.5)  # nothing more comes: each event arrives once
        received = receiver.received

    assert len(received) == 5
    for request in received:
        event = client.webhooks.unwrap(
            request.body,
            request.headers,
            secret=everything["secret"] if request.path == "/all" else failures["secret"],
        )
        assert event.data.id == batches[event.type]
        assert event.object == "event" and event.id.startswith("evt_")
        assert request.headers["webhook-id"].startswith("wh_")
        assert json.loads(request.body) == {
            "id": event.id,
            "object": "event",
            "type": event.type,
            "created_at": event.created_at,
            "data": {"id": event.data.id},
        }
        batch = client.batches.retrieve(event.data.id)
        assert batch.status == event.type.removeprefix("batch.")
        assert event.created_at == getattr(batch, f"{batch.status}_at")
    by_path = {
        path: sorted(json.loads(r.body)["type"] for r in received if r.path == path)
        for path in ("/all", "/failed")
    }
    assert by_path == {"/all": sorted(batches), "/failed": ["batch.failed"]}
    # The signature binds the body: a changed one is rejected.
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(
            received[0].body.replace(b"batch_", b"batch_x"),
            received[0].headers,
            secret=everything["secret"] if received[0].path == "/all" else failures["secret"],
        )
    log = deliveries(server, everything["id"])
    assert sorted(d["event_type"] for d in log) == sorted(batches)
    assert {(d["attempt"], d["outcome"], d["status_code"]) for d in log} == {(1, "delivered", 200)}


def test_a_receiver_down_then_failing_gets_the_event_once_back_with_the_same_id(
    serve_batches,
):
    server: BatchServer = serve_batches(**FAST_WEBHOOKS)
    client = server.client()
    with Receiver() as reserved:
        port = reserved.port  # held only to pick a port; nothing listens once it stops
    endpoint = register(server, f"http://127.0.0.1:{port}/hook")
    batch_id = start_batch(client, [line("a")])

    # Down: connections are refused, and each attempt is logged.
    wait_for(lambda: len(deliveries(server, endpoint["id"])) >= 3)
    # Back, but failing twice before it works.
    with Receiver(port=port, statuses=[500, 500]) as receiver:
        receiver.wait_for(lambda got: [r.status for r in got] == [500, 500, 200])
        wait_for(lambda: deliveries(server, endpoint["id"])[-1]["outcome"] == "delivered")
        time.sleep(0.5)  # delivered: no attempt follows
        received = receiver.received

    assert [r.status for r in received] == [500, 500, 200]
    assert len({r.headers["webhook-id"] for r in received}) == 1
    for request in received:
        event = client.webhooks.unwrap(request.body, request.headers, secret=endpoint["secret"])
        assert (event.type, event.data.id) == ("batch.completed", batch_id)

    log = deliveries(server, endpoint["id"])
    down = log[:-3]
    assert [d["attempt"] for d in log] == list(range(1, len(log) + 1))
    assert {d["webhook_id"] for d in log} == {received[0].headers["webhook-id"]}
    assert len(down) >= 3
    assert all(d["outcome"] == "failed" and d["status_code"] is None for d in down)
    assert all(d["error"].startswith("connection failed") for d in down)
    assert [(d["outcome"], d["status_code"]) for d in log[-3:]] == [
        ("failed", 500),
        ("failed", 500),
        ("delivered", 200),
    ]


def test_a_tenant_never_receives_another_tenants_events(serve_batches):
    server: BatchServer = serve_batches(api_keys=["alice", "bob"], **FAST_WEBHOOKS)
    with Receiver() as receiver:
        alice = register(server, receiver.url("/alice"), "alice")
        bob = register(server, receiver.url("/bob"), "bob")
        alices = start_batch(server.client("alice"), [line("a")])
        bobs = start_batch(server.client("bob"), [line("b")])
        receiver.wait_for(lambda got: len(got) == 2)
        time.sleep(0.5)
        received = receiver.received

    client = server.client("alice")
    assert len(received) == 2
    for name, endpoint, batch_id in [("alice", alice, alices), ("bob", bob, bobs)]:
        [request] = [r for r in received if r.path == f"/{name}"]
        event = client.webhooks.unwrap(request.body, request.headers, secret=endpoint["secret"])
        assert event.data.id == batch_id
        assert [d["batch_id"] for d in deliveries(server, endpoint["id"], name)] == [batch_id]

    # Deleting an endpoint takes its messages and delivery log with it.
    http = server.http("alice")
    assert http.delete(f"/v1/webhook_endpoints/{alice['id']}").json()["deleted"] is True
    assert http.get(f"/v1/webhook_endpoints/{alice['id']}/deliveries").status_code == 404
