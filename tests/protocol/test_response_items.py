"""A Responses request is the chat request it amounts to (serving/responses.py): its prompt is
chat's for the same conversation, history first; its input items list as OpenAI lists them; the
engine's output becomes message and function_call items, and a refusal names the Responses
field."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pagedbatch.engine import EngineArgs, LLMEngine
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.responses import ResponseCreateRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.common import parse_request
from pagedbatch.protocol.serving.media import fetches_media
from pagedbatch.protocol.serving.responses import longest_token_bytes, prepare_response

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama), max_num_seqs=2, num_kv_blocks=64))


def responses(served: LLMEngine, history: list[dict[str, Any]] = (), **body: Any):
    request = parse_request(ResponseCreateRequest, {"model": served.model_name, **body})
    return prepare_response(request, served, history)


def chat_prompt(served: LLMEngine, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    request = parse_request(
        ChatCompletionRequest, {"model": served.model_name, "messages": messages, **body}
    )
    return prepare_chat(request, served).inputs[0].prompt_token_ids


def test_the_prompt_is_chats_for_the_same_conversation(served):
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "status": "completed",
        },
    ]
    prepared = responses(
        served,
        history,
        instructions="Be brief.",
        previous_response_id="resp_1",
        input=[
            {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER],
    )
    chat = chat_prompt(
        served,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Hello!"}],
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Rain"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object"}},
            }
        ],
    )
    assert prepared.inputs[0].prompt_token_ids == chat
    assert prepared.id.startswith("resp_") and prepared.inputs[0].request_id == prepared.id
    # Only this request's items are its input items, each with an id.
    first, second = prepared.input_items()
    assert first["type"] == "function_call_output" and first["id"].startswith("fco_")
    assert second["role"] == "user" and second["id"].startswith("msg_")
    assert second["content"] == [{"type": "input_text", "text": "And tomorrow?"}]
    assert prepared.input_texts() == ["Hi", "And tomorrow?"]


def test_a_string_input_is_one_user_message_and_formats_become_response_formats(served):
    prepared = responses(served, input="Hello", text={"format": {"type": "json_object"}})
    assert prepared.inputs[0].prompt_token_ids == chat_prompt(
        served, [{"role": "user", "content": "Hello"}]
    )
    assert prepared.inputs[0].params.structured is not None
    assert prepared.placeholder("queued").status == "queued"
    assert prepared.placeholder("queued").output == []


def output(text: str, reason: str, tokens: int = 3) -> list[RequestOutput]:
    choice = CompletionOutput(0, text, list(range(tokens)), finish_reason=reason)
    return [RequestOutput("r", [1, 2, 3, 4], [choice], finished=True, num_cached_tokens=2)]


def test_outputs_become_message_and_function_call_items(served):
    prepared = responses(served, input="Hello")
    answered = prepared.response(output("Hi there", "stop"))
    assert answered.status == "completed" and answered.incomplete_details is None
    (message,) = answered.output
    assert message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].text == "Hi there" and message.content[0].annotations == []
    usage = answered.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (4, 3, 7)
    assert usage.input_tokens_details.cached_tokens == 2

    cut = prepared.response(output("Hi th", "length"))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"

    calling = responses(served, input="Weather?", tools=[WEATHER])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    (call,) = calling.response(output(text, "stop")).output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Oslo"}' and call.call_id.startswith("call_")

    with pytest.raises(OpenAIError) as aborted:
        prepared.response(output("", "abort"))
    assert aborted.value.status_code == 503


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]}, "tools[0]"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 1}}},
            },
            "text.format",
        ),
        (
            {
                "input": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
                        ],
                    }
                ]
            },
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "//79"}]}]},
            "input[0].content[0].file_data",
        ),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_refusals_name_the_responses_field(served, body, param):
    with pytest.raises(OpenAIError) as refused:
        responses(served, **body)
    assert refused.value.detail.param == param


def test_an_input_file_of_text_is_read_as_text(served):
    data = "data:text/plain;base64," + "SGVsbG8gZmlsZQ=="  # "Hello file"
    part = {"type": "input_file", "filename": "a.txt", "file_data": data}
    prepared = responses(served, input=[{"role": "user", "content": [part]}])
    assert prepared.inputs[0].prompt_token_ids == chat_prompt(
        served, [{"role": "user", "content": [{"type": "text", "text": "Hello file"}]}]
    )


def test_an_input_image_by_url_is_prepared_on_the_fetching_threads():
    def request(url: str) -> ResponseCreateRequest:
        part = {"type": "input_image", "image_url": url}
        items = [{"role": "user", "content": [part]}]
        return parse_request(ResponseCreateRequest, {"model": "m", "input": items})

    assert fetches_media(request("https://example.com/cat.png"))
    assert not fetches_media(request("data:image/png;base64,AAAA"))
    assert not fetches_media(parse_request(ResponseCreateRequest, {"model": "m", "input": "x"}))


def test_truncation_auto_drops_the_oldest_items_that_do_not_fit(served):
    # Each item about a fifth of the context: all twelve cannot fit.
    text = " ".join(["word"] * (served.max_model_len // 5))
    items = [{"role": "user", "content": f"{i} {text}"} for i in range(12)] + [
        {"role": "user", "content": "last"}
    ]
    body = {"input": items, "instructions": "Be brief.", "max_output_tokens": 16}
    with pytest.raises(OpenAIError) as refused:
        responses(served, **body)
    assert refused.value.detail.code == "context_length_exceeded"
    assert refused.value.detail.param == "input"

    prompt = responses(served, **body, truncation="auto").inputs[0].prompt_token_ids
    assert len(prompt) + 16 <= served.max_model_len
    system = [{"role": "system", "content": "Be brief."}]
    kept = len(items) - 1
    while chat_prompt(served, system + items[kept:]) != prompt:
        kept -= 1
    assert 0 < kept < len(items) - 1
    with pytest.raises(OpenAIError):  # one item more would not have fit
        chat_prompt(served, system + items[kept - 1 :], max_completion_tokens=16)


def test_no_token_stands_for_more_text_than_the_longest_token_bytes(served):
    tokenizer = served.tokenizer
    longest = longest_token_bytes(tokenizer)
    rng = random.Random(0)
    pieces = ["word", " ", "\n", "    ", "é", "東京", "🌊", "the", "ing", "\t", "0123456789"]
    for _ in range(50):
        text = "".join(rng.choices(pieces, k=rng.randint(1, 400)))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert len(tokens) * longest >= len(text.encode())


def test_truncation_auto_tries_only_suffixes_that_might_fit(served):
    """A conversation of many times the context: the suffixes whose text alone is too long are
    dropped untried, and the answer is what bisection over all of them finds."""
    longest = longest_token_bytes(served.tokenizer)
    text = " ".join(["word"] * (served.max_model_len // 8))
    items = [{"role": "user", "content": f"{i} {text}"} for i in range(400)]
    assert sum(len(i["content"]) for i in items) > 4 * longest * served.max_model_len
    body = {"input": items, "max_output_tokens": 16, "truncation": "auto"}

    prompt = responses(served, **body).inputs[0].prompt_token_ids
    assert len(prompt) + 16 <= served.max_model_len
    kept = len(items) - 1
    while chat_prompt(served, items[kept:]) != prompt:
        kept -= 1
    with pytest.raises(OpenAIError):  # one item more would not have fit
        chat_prompt(served, items[kept - 1 :], max_completion_tokens=16)
