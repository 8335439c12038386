"""A 128K-token prompt through the realtime API: it completes, its usage is exact, and a longer
one is a 400 naming the limit."""

from __future__ import annotations

import openai
import pytest
from test_batches import assert_engine_idle

CONTEXT = 131_072


def test_a_128k_prompt_through_the_realtime_api(serve_batches, narrow_long):
    server = serve_batches(model=str(narrow_long), served_model_name="long")
    client = server.client()
    prompt = [(i * 7919) % 16_000 + 10 for i in range(CONTEXT - 16)]
    answer = client.completions.create(
        model="long", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.usage.prompt_tokens == CONTEXT - 16
    assert answer.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="long", prompt=[*prompt, 1, 2], max_tokens=16)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in caught.value.body["message"]
    assert_engine_idle(server)
