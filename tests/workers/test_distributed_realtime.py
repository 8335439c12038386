"""The realtime door of the distributed deployment, with real processes: the API forwards each
request to a worker's engine host and streams the answer back; with no worker it answers 503,
and it recovers as soon as a worker is back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from servers import PROCESS_START_SECONDS, Deployment, engine_records, eventually
from test_distributed import deployment  # noqa: F401 - a fixture

from pagedbatch.engine import LLM, SamplingParams

STORY = "Tell me a story."
MESSAGES = [{"role": "user", "content": STORY}]
LONG = {"max_tokens": 1500, "ignore_eos": True}  # still running when the test acts on it
RESPONSE = {"model": "tiny", "temperature": 0, "max_output_tokens": 16}
ROLES = ["user", "assistant", "user"]


def engine_load(running: Deployment) -> dict[str, Any]:
    """The worker's own figures, from its engine host."""
    (host,) = engine_records(running.env["PAGEDBATCH_BROKER_URL"])
    return httpx.get(f"{host.address}/internal/load").json()


def until_served(client: openai.OpenAI) -> None:
    def served() -> bool:
        try:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
        except openai.InternalServerError:
            return False
        return True

    eventually(served, timeout=PROCESS_START_SECONDS)


def assert_unavailable(call: Callable[[], Any]) -> None:
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        call()
    assert time.monotonic() - started < 2.0  # a gone host refuses at once: no waiting it out
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "engine_unavailable"
    assert "No engine serving model 'tiny' can be reached right now" in caught.value.message


def test_realtime_requests_reach_a_worker_engine_and_recover_after_it_dies(
    deployment,  # noqa: F811 - the fixture imported above
    tiny_llama,
):
    client = deployment.client()
    greedy = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert_unavailable(lambda: client.chat.completions.create(**greedy))

    worker = deployment.start_worker("worker")
    until_served(client)
    chunks = list(client.chat.completions.create(**greedy, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    (expected,) = llm.generate(
        [llm.tokenizer.encode(prompt, add_special_tokens=False)],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert streamed == expected.text

    # A client leaving mid-stream ends the request in the worker's engine, blocks and all.
    with httpx.Client(base_url=deployment.url, timeout=60) as http:
        body = {"model": "tiny", "messages": MESSAGES, "stream": True, **LONG}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = response.iter_lines()  # kept: dropping it would hang up
            assert next(events).startswith("data: ")
            assert engine_load(deployment)["running"] == 1
    eventually(lambda: engine_load(deployment)["running"] == 0, timeout=2.0)
    assert engine_load(deployment)["kv_usage"] == 0.0 and engine_load(deployment)["admitted"] == 0

    # A response is kept where it runs, on the engine host, in the job store the API reads.
    first = client.responses.create(input=STORY, **RESPONSE)
    assert client.responses.retrieve(first.id) == first
    assert client.responses.input_items.list(first.id).data[0].content[0].text == STORY

    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    assert_unavailable(lambda: client.chat.completions.create(**greedy, stream=True))

    deployment.start_worker("again")
    until_served(client)
    again = client.chat.completions.create(**greedy)
    assert again.choices[0].message.content == expected.text

    # The next worker's host continues the first one's response, as if sent whole.
    assert client.responses.retrieve(first.id) == first
    second = client.responses.create(input="More.", previous_response_id=first.id, **RESPONSE)
    turns = [STORY, first.output_text, "More."]
    whole = client.responses.create(
        input=[{"role": role, "content": text} for role, text in zip(ROLES, turns, strict=True)],
        **RESPONSE,
    )
    assert (second.output_text, second.usage.input_tokens) == (
        whole.output_text,
        whole.usage.input_tokens,
    )
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
