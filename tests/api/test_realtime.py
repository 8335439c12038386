"""The realtime door end to end, on the embedded service: chat and completions through the
official SDK, whole and streamed; exact streaming; bad requests; disconnects; backpressure; and
realtime requests going ahead of batch work on the same engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import BatchServer
from test_batches import chat_line, create, finished, read_lines

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.common import parse_request
from pagedbatch.protocol.serving.streaming import ChatChunks, StreamEncoder

pytestmark = pytest.mark.parametrize("storage", ["embedded"], indirect=True)

MiB = 1 << 20
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story."},
]
# Long enough that a request still runs when the test acts on it (some seconds on two cores).
LONG = {"max_tokens": 1500, "ignore_eos": True}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, **fields}


def parse_events(text: str) -> list[Any]:
    """The data of each server-sent event: decoded JSON, or the final "[DONE]"."""
    assert text.endswith("\n\n"), text[-200:]
    found = []
    for event in text.removesuffix("\n\n").split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, event
        data = event.removeprefix("data: ")
        found.append(data if data == "[DONE]" else json.loads(data))
    return found


def stream(server: BatchServer, path: str, body: dict[str, Any]) -> list[Any]:
    with server.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_events(response.text)


def stats(server: BatchServer) -> dict[str, Any]:
    return asyncio.run(server.embedded.context.engine.get_stats())


def idle(engine_stats: dict[str, Any]) -> bool:
    return (
        engine_stats["running"] == engine_stats["waiting"] == 0
        and engine_stats["free_kv_blocks"] == engine_stats["total_kv_blocks"]
    )


def seconds_until(condition: Callable[[], bool], timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"still not so after {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - start


def seconds_until_idle(server: BatchServer) -> float:
    return seconds_until(lambda: idle(stats(server)))


def chat_prompt_ids(server: BatchServer, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = server.embedded.context.engine.tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def streamed_text(chunks: list[Any], index: int = 0) -> str:
    """The text of one choice of a streamed chat completion, from the SDK's chunks."""
    return "".join(
        choice.delta.content or ""
        for chunk in chunks
        for choice in chunk.choices
        if choice.index == index
    )


# The SDK, whole and streamed.


def test_chat_through_the_sdk_whole_and_streamed(serve_batches):
    server = serve_batches()
    client = server.client()
    args = dict(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=12,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion" and whole.model == "tiny"
    assert whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    prompt_tokens = len(chat_prompt_ids(server, MESSAGES))
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == prompt_tokens + 12

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].id != whole.id
    assert all(
        chunk.object == "chat.completion.chunk" and chunk.model == "tiny" for chunk in chunks
    )
    roles = [chunk.choices[0].delta.role for chunk in chunks]
    assert roles == ["assistant"] + [None] * (len(chunks) - 1)
    reasons = [chunk.choices[0].finish_reason for chunk in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["length"]
    assert streamed_text(chunks) == choice.message.content
    assert all(chunk.usage is None for chunk in chunks)
    assert idle(stats(server))


def test_include_usage_adds_a_last_chunk_with_only_the_usage(serve_batches):
    server = serve_batches()
    whole = server.client().chat.completions.create(**chat_body(seed=5))

    plain = stream(server, "/v1/chat/completions", chat_body(seed=5, stream=True))
    assert plain[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in plain[:-1])

    counted = stream(
        server,
        "/v1/chat/completions",
        chat_body(seed=5, stream=True, stream_options={"include_usage": True}),
    )
    *chunks, last, done = counted
    assert done == "[DONE]"
    assert chunks and all(chunk["usage"] is None and chunk["choices"] for chunk in chunks)
    assert last["choices"] == [] and last["id"] == chunks[0]["id"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: last["usage"][k] for k in counts} == {k: getattr(whole.usage, k) for k in counts}
    # The same prompt again: the prefix cache held its full blocks.
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks)
    assert text == whole.choices[0].message.content


def test_n_choices_stream_by_index(serve_batches):
    server = serve_batches()
    client = server.client()
    args = dict(model="tiny", messages=MESSAGES, max_tokens=20, n=2, seed=11)
    whole = client.chat.completions.create(**args)
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert whole.choices[0].message.content != whole.choices[1].message.content

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert all(len(chunk.choices) == 1 for chunk in chunks)
    for choice in whole.choices:
        own = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == choice.index]
        assert own[0].delta.role == "assistant"
        assert [c.finish_reason for c in own] == [None] * (len(own) - 1) + [choice.finish_reason]
        assert streamed_text(chunks, choice.index) == choice.message.content


def test_completions_whole_and_streamed_with_logprobs(serve_batches):
    server = serve_batches()
    client = server.client()
    args = dict(model="tiny", prompt=["Once upon a time", "The end"], n=2, max_tokens=10)
    whole = client.completions.create(**args, seed=2, logprobs=2)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)

    chunks = list(client.completions.create(**args, seed=2, logprobs=2, stream=True))
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    for choice in whole.choices:
        own = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == choice.index]
        assert "".join(c.text for c in own) == choice.text
        assert [c.finish_reason for c in own] == [None] * (len(own) - 1) + [choice.finish_reason]
        for field in ("tokens", "text_offset"):
            streamed = [x for c in own for x in getattr(c.logprobs, field)]
            assert streamed == getattr(choice.logprobs, field), field
        streamed = [x for c in own for x in c.logprobs.token_logprobs]
        assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)

    echoed = client.completions.create(**args, seed=2, echo=True)
    echoed_chunks = list(client.completions.create(**args, seed=2, echo=True, stream=True))
    for choice in echoed.choices:
        own = [
            chunk.choices[0] for chunk in echoed_chunks if chunk.choices[0].index == choice.index
        ]
        assert own[0].text.startswith(args["prompt"][choice.index // 2])
        assert "".join(c.text for c in own) == choice.text


def test_chat_logprobs_stream_token_by_token(serve_batches):
    client = serve_batches().client()
    args = dict(model="tiny", messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**args, seed=4)
    chunks = list(client.chat.completions.create(**args, seed=4, stream=True))
    streamed = [entry for chunk in chunks for entry in chunk.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.bytes for e in streamed] == [e.bytes for e in expected]
    # The second run reads the prompt from the prefix cache, which rounds a little differently.
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert len(streamed) == 12 and all(len(entry.top_logprobs) == 3 for entry in streamed)


def test_a_failure_once_streaming_has_begun_is_an_error_event(serve_batches):
    """The status line has gone out, so the failure is told as the SDK expects: an event holding
    `{"error": {...}}`, which it raises as an APIError."""
    served = serve_batches().embedded.context.engine.engine
    request = parse_request(ChatCompletionRequest, chat_body(stream=True))
    prepared = prepare_chat(request, served)
    encoder = StreamEncoder(ChatChunks(prepared), request)
    partial = CompletionOutput(index=0, text="Once", token_ids=[7])
    output = RequestOutput(prepared.id, prepared.inputs[0].prompt_token_ids, [partial])
    (chunk,) = parse_events(encoder.events([output]).decode())
    assert chunk["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "Once",
        "refusal": None,
        "tool_calls": None,
    }

    aborted = replace(partial, finish_reason="abort")
    with pytest.raises(OpenAIError) as caught:
        encoder.events([replace(output, outputs=[aborted], finished=True)])
    (event,) = parse_events(encoder.error(caught.value).decode())
    assert event == {
        "error": {
            "message": "The request was aborted before it finished.",
            "type": "server_error",
            "param": None,
            "code": "request_aborted",
        }
    }


# Exact streaming.


def test_a_stop_string_across_tokens_ends_the_text_and_never_shows(serve_batches):
    server = serve_batches()
    client = server.client()
    free = client.completions.create(**completion_body(max_tokens=40, temperature=0, logprobs=0))
    tokens = free.choices[0].logprobs.tokens
    # The end of one token and the start of the next, somewhere past the first few tokens.
    k = next(i for i in range(4, len(tokens) - 1) if len(tokens[i]) > 1 and len(tokens[i + 1]) > 1)
    stop = tokens[k][-2:] + tokens[k + 1][:2]
    expected = free.choices[0].text[: free.choices[0].text.index(stop)]

    body = completion_body(max_tokens=40, temperature=0, stop=["never there", stop])
    whole = client.completions.create(**body)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    chunks = stream(server, "/v1/completions", {**body, "stream": True})[:-1]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_text_never_splits_a_character(serve_batches):
    server = serve_batches()
    tokenizer = server.embedded.context.engine.tokenizer
    # Tokens that each hold one byte of a two- or three-byte character, and nothing else to say.
    byte_tokens = tokenizer.encode("é€", add_special_tokens=False)
    assert len(byte_tokens) == 5
    body = chat_body(max_tokens=40, seed=8, logit_bias={str(t): 100 for t in byte_tokens})
    whole = server.client().chat.completions.create(**body)
    text = whole.choices[0].message.content
    assert "é" in text or "€" in text  # characters made of several tokens

    chunks = stream(server, "/v1/chat/completions", {**body, "stream": True})[:-1]
    deltas = [chunk["choices"][0]["delta"]["content"] for chunk in chunks]
    assert "".join(deltas) == text
    # A character split between chunks would show as U+FFFD where the whole text has none.
    assert sum(delta.count("\ufffd") for delta in deltas) == text.count("\ufffd")


def test_seeded_sampling_is_reproducible(serve_batches):
    client = serve_batches().client()
    body = chat_body(max_tokens=24, temperature=1.0)
    first, again, other = (
        client.chat.completions.create(**body, seed=seed).choices[0].message.content
        for seed in (1234, 1234, 4321)
    )
    assert first == again != other


def test_greedy_realtime_output_equals_llm_generate(serve_batches):
    server = serve_batches()
    client = server.client()
    chat = client.chat.completions.create(**chat_body(max_tokens=24, temperature=0))
    chat_stream = list(
        client.chat.completions.create(**chat_body(max_tokens=24, temperature=0), stream=True)
    )
    completion = client.completions.create(**completion_body(max_tokens=24, temperature=0))

    tokenizer = server.embedded.context.engine.tokenizer
    llm = LLM(server.settings.model, num_kv_blocks=64)
    expected_chat, expected_completion = llm.generate(
        [
            chat_prompt_ids(server, MESSAGES),
            tokenizer.encode("Once upon a time", add_special_tokens=True),
        ],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert chat.choices[0].message.content == expected_chat.text
    assert streamed_text(chat_stream) == expected_chat.text
    assert completion.choices[0].text == expected_completion.text
    assert chat.usage.completion_tokens == len(expected_chat.token_ids)


# Bad requests.

TOO_LONG = [{"role": "user", "content": "hello " * 2100}]
BAD_REQUESTS = {
    "unknown-model": ("chat", {"model": "nope"}, 404, "model", "model_not_found"),
    "too-long": ("chat", {"messages": TOO_LONG}, 400, "messages", "context_length_exceeded"),
    "too-many-tokens": ("chat", {"max_tokens": 4096}, 400, "messages", "context_length_exceeded"),
    "temperature": ("chat", {"temperature": 3}, 400, "temperature", "invalid_value"),
    "n": ("chat", {"n": 0}, 400, "n", "invalid_value"),
    "no-content": (
        "chat",
        {"messages": [{"role": "user"}]},
        400,
        "messages[0].content",
        "missing_required_parameter",
    ),
    "role": ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    "image": (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        },
        400,
        "messages[0].content[0]",
        "unsupported_content_type",
    ),
    "top-logprobs-alone": ("chat", {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    "options-without-stream": (
        "chat",
        {"stream": False, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    "typo": ("chat", {"max_token": 5}, 400, "max_token", "unknown_parameter"),
    "completion-model": ("completion", {"model": "nope"}, 404, "model", "model_not_found"),
    "logprobs": ("completion", {"logprobs": 6}, 400, "logprobs", "invalid_value"),
    "token-ids": ("completion", {"prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    "long-prompt": (
        "completion",
        {"prompt": "hello " * 2100},
        400,
        "prompt",
        "context_length_exceeded",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_get_openai_errors_and_never_reach_the_engine(serve_batches, case):
    endpoint, fields, status, param, *code = case
    server = serve_batches()
    path, body = (
        ("/v1/chat/completions", chat_body(**fields))
        if endpoint == "chat"
        else ("/v1/completions", completion_body(**fields))
    )
    before = stats(server)
    with server.http() as http:
        for streamed in (False, True):
            response = http.post(path, json={"stream": streamed, **body})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error"
            if code:
                assert error["code"] == code[0]
    after = stats(server)
    for key in ("steps", "finished_requests", "running", "waiting", "free_kv_blocks"):
        assert after[key] == before[key], key


def test_without_an_engine_the_api_answers_503(serve):
    """An app given neither an engine nor the workers' (the distributed API has the latter:
    tests/workers/test_engine_host.py)."""
    client = serve(served_models=["tiny"]).client()
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert caught.value.status_code == 503
    assert "No engine serves model 'tiny'" in caught.value.message
    assert caught.value.body["code"] == "engine_unavailable"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi")


# Disconnects and backpressure.


def test_a_client_leaving_mid_stream_frees_its_blocks_at_once(serve_batches):
    server = serve_batches()
    with server.http() as http:
        request = chat_body(stream=True, **LONG)
        with http.stream("POST", "/v1/chat/completions", json=request) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            running = stats(server)
            assert running["running"] == 1
            assert running["free_kv_blocks"] < running["total_kv_blocks"]
        # Leaving the block closed the connection; the request had seconds of work left.
        assert seconds_until_idle(server) < 1.0


def test_a_client_leaving_before_a_whole_response_frees_its_blocks_at_once(serve_batches):
    server = serve_batches()
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=completion_body(n=3, **LONG), timeout=0.5)
    assert seconds_until_idle(server) < 1.0


def test_beyond_the_queue_bound_clients_get_429_with_retry_after(serve_batches):
    server = serve_batches(max_realtime_queue=2)
    client = server.client()
    with server.http() as http, ExitStack() as held:
        body = completion_body(stream=True, **LONG)
        streams = [
            held.enter_context(http.stream("POST", "/v1/completions", json=body)) for _ in range(2)
        ]
        assert [response.status_code for response in streams] == [200, 200]
        lines = [response.iter_lines() for response in streams]  # kept: closing one hangs up
        assert all(next(events).startswith("data: ") for events in lines)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(**chat_body())
        assert caught.value.status_code == 429
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["code"] == "rate_limit_exceeded"
        assert stats(server)["running"] == 2  # the refused request never reached the engine

        streams[0].close()

        def admitted() -> bool:  # once the server has seen the client go, its slot is free
            try:
                client.chat.completions.create(**chat_body())
            except openai.RateLimitError:
                return False
            return True

        seconds_until(admitted, timeout=5)
    seconds_until_idle(server)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def stream_clients(url: str, count: int) -> list[tuple[int, str]]:
    """`count` streaming chat clients at once; each one's status and what it was sent."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:

        async def one(i: int) -> tuple[int, str]:
            body = chat_body(max_tokens=16, seed=i, stream=True)
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                return response.status_code, (await response.aread()).decode()

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_200_streaming_clients_each_complete_or_get_429_in_bounded_memory(serve_batches):
    server = serve_batches(max_realtime_queue=8)  # in this process: its peak RSS is ours
    asyncio.run(stream_clients(server.url, 20))  # what the first burst loads, every later one uses
    baseline = peak_rss()
    results = asyncio.run(stream_clients(server.url, 200))
    growth = peak_rss() - baseline

    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    served = [body for status, body in results if status == 200]
    assert len(served) >= 8 and statuses.count(429) > 0
    for body in served:
        *chunks, done = parse_events(body)
        assert done == "[DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    for status, body in results:
        if status == 429:
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    assert growth < 64 * MiB, f"peak RSS grew by {growth / MiB:.1f} MiB"
    admission = server.embedded.app.state.realtime_admissions["tiny"]
    seconds_until(lambda: admission.admitted == 0, timeout=5)  # the last may still be closing
    seconds_until_idle(server)


# Realtime ahead of batch.


def test_a_realtime_request_runs_ahead_of_a_running_batch(serve_batches):
    # Two shards of four lines run at once, each line 16 completions: 128 sequences, the engine's
    # max_num_seqs, so a realtime request can only start at once by preempting batch work.
    server = serve_batches(shard_size=4, worker_concurrency=2)
    client = server.client()
    lines = [chat_line(f"r{i}", max_tokens=100, n=16, ignore_eos=True) for i in range(8)]
    batch = create(client, lines)
    seconds_until(lambda: stats(server)["running"] == 128, timeout=60)
    preemptions = stats(server)["preemptions"]

    realtime = client.chat.completions.create(**chat_body(extra_body={"ignore_eos": True}))
    assert realtime.usage.completion_tokens == 16
    # It ran beside the batch, not after it: batch work made way, and no line has finished yet.
    assert stats(server)["preemptions"] > preemptions
    assert client.batches.retrieve(batch.id).request_counts.completed == 0

    batch = finished(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.completed == batch.request_counts.total == 8
    # Preempted lines resumed and lost nothing.
    for line in read_lines(client, batch.output_file_id):
        assert line["response"]["body"]["usage"]["completion_tokens"] == 16 * 100
