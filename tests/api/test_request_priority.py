"""vLLM's per-request `priority` through the official SDK (`extra_body`) at both doors, on the
embedded service with one sequence at a time: requests of a door run lowest priority first
(realtime still ahead of batch lines); out of bounds is an OpenAI-shaped 400."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from test_batches import create, finished, read_lines

pytestmark = pytest.mark.parametrize("storage", ["embedded"], indirect=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
LONG = {"max_tokens": 300, "ignore_eos": True}


def scheduler(server):
    return server.embedded.context.engine.engine.scheduler


def finishing_order(server, count: int, within: float = 60.0) -> list[int]:
    """The user priorities of the engine's requests in the order they finish (leave its queues
    for good: a preempted one goes back to waiting), until `count` have."""
    seen: list[int] = []
    finished: list[int] = []
    deadline = time.monotonic() + within
    while len(finished) < count:
        assert time.monotonic() < deadline, f"only {finished} of {seen} finished"
        queues = scheduler(server)
        live = [r.user_priority for r in [*queues.running, *queues.waiting]]
        seen += [p for p in live if p not in seen]
        finished += [p for p in seen if p not in live and p not in finished]
        time.sleep(0.002)
    return finished


def test_realtime_requests_run_lowest_priority_first(serve_batches):
    # One sequence at a time: a waiting request of a lower priority preempts a running one.
    server = serve_batches(max_num_seqs=1)
    client = server.client()
    priorities = [5, -10, 0, -5]

    def chat(priority: int) -> None:
        body = {**LONG, "priority": priority}
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=body)

    threads = [threading.Thread(target=chat, args=(p,)) for p in priorities]
    for thread in threads:
        thread.start()
    order = finishing_order(server, len(priorities))
    for thread in threads:
        thread.join(timeout=60)
    assert order == sorted(priorities)


def test_batch_lines_run_lowest_priority_first(serve_batches):
    # A line a shard, the four shards at once: every line is in the engine together.
    server = serve_batches(max_num_seqs=1, shard_size=1, worker_concurrency=4)
    client = server.client()
    priorities = [5, -10, 0, -5]
    lines = [
        {
            "custom_id": f"p{p}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": MESSAGES, **LONG, "priority": p},
        }
        for p in priorities
    ]
    batch = create(client, lines)
    order = finishing_order(server, len(priorities))
    batch = finished(client, batch.id)
    assert batch.request_counts.completed == len(priorities)
    assert len(read_lines(client, batch.output_file_id)) == len(priorities)
    assert order == sorted(priorities)


@pytest.mark.parametrize("priority", [1001, -1001, 1.5, "high"])
def test_priority_out_of_bounds_is_a_400(serve_batches, priority):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"priority": priority}
        )
    assert caught.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": priority}
        )
    assert caught.value.body["param"] == "priority"
