"""A 128K-token prompt through the realtime API: it completes, its usage is exact, a short request
sent meanwhile is answered within its prefill, and a longer prompt is a 400 naming the limit, in
a realtime request and in a batch line (refused at validation)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from servers import eventually
from test_batches import assert_engine_idle, create, finished, results

CONTEXT = 131_072
CHUNK = 2_048  # the default max_num_batched_tokens: the long prefill takes 64 steps


def test_a_128k_prompt_through_the_realtime_api(serve_batches, narrow_long):
    server = serve_batches(model=str(narrow_long), served_model_name="long")
    engine = server.embedded.context.engine.engine
    client = server.client()
    prompt = [(i * 7919) % 16_000 + 10 for i in range(CONTEXT - 16)]
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            client.completions.create,
            model="long",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        eventually(lambda: engine.get_stats()["batched_tokens"] >= 8 * CHUNK, timeout=120)
        # A short request sent mid-prefill has its first token within two steps (the one then
        # running, and the next, which takes its prompt beside a chunk of the long one).
        sent_at_step = engine.get_stats()["steps"]
        short = client.completions.create(model="long", prompt="Hi", max_tokens=4, stream=True)
        next(iter(short))
        assert engine.get_stats()["steps"] - sent_at_step <= 2
        assert not long.done()
        short.close()
        answer = long.result()
    assert answer.usage.prompt_tokens == CONTEXT - 16
    assert answer.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="long", prompt=[*prompt, 1, 2], max_tokens=16)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in caught.value.body["message"]
    assert_engine_idle(server)


def test_a_batch_line_past_the_context_is_refused_alone(serve_batches, narrow_long):
    server = serve_batches(model=str(narrow_long), served_model_name="long")
    client = server.client()
    prompt = [(i * 7919) % 16_000 + 10 for i in range(CONTEXT - 14)]

    def line(custom_id: str, prompt: list[int] | str) -> dict:
        body = {"model": "long", "prompt": prompt, "max_tokens": 16}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    lines = [line("long", prompt), line("short", "Once upon a time")]
    batch = finished(client, create(client, lines, endpoint="/v1/completions").id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    output, errors = results(client, batch)
    assert [o["custom_id"] for o in output] == ["short"]
    [refused] = errors
    assert refused["custom_id"] == "long" and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert server.embedded.context.engine.engine.get_stats()["prompt_tokens"] < 100
