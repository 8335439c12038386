"""Request bodies, error shapes and batch lines, as a client of the OpenAI API sees them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedbatch.protocol.batch_lines import InputLineChecker, InvalidBatchLine
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import (
    AssistantMessage,
    ChatCompletionRequest,
    ImagePart,
    JSONSchemaFormat,
    ToolMessage,
)
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.serving.common import parse_request

USER = {"role": "user", "content": "Hi"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def rejection(schema: type, body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_request(schema, body)
    return caught.value


class TestChatRequest:
    def test_defaults_are_openais(self):
        request = parse_request(ChatCompletionRequest, chat())
        assert request.temperature == 1.0
        assert request.top_p == 1.0
        assert request.n == 1
        assert request.stream is False
        assert request.logprobs is False
        assert request.max_tokens is None
        assert request.max_completion_tokens is None
        assert request.stop is None

    def test_null_means_default(self):
        request = parse_request(ChatCompletionRequest, chat(temperature=None, n=None, stop=None))
        assert (request.temperature, request.n, request.stop) == (1.0, 1, None)

    def test_every_role_and_content_form(self):
        messages = [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}], "name": "s"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "file-1"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "function", "name": "f", "content": "43"},
        ]
        request = parse_request(ChatCompletionRequest, chat(messages=messages))
        assert [m.role for m in request.messages] == [m["role"] for m in messages]
        assert isinstance(request.messages[2].content[1], ImagePart)
        assert isinstance(request.messages[3], AssistantMessage)
        assert request.messages[3].tool_calls[0].function.name == "f"
        assert isinstance(request.messages[4], ToolMessage)

    def test_a_response_message_can_be_sent_back_as_it_came(self):
        echoed = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": []}
        request = parse_request(ChatCompletionRequest, chat(messages=[USER, echoed, USER]))
        assert request.messages[1].content == "Hello"

    def test_tools_and_structured_output_are_typed(self):
        body = chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
            },
        )
        request = parse_request(ChatCompletionRequest, body)
        assert request.tools[0].function.name == "f"
        assert isinstance(request.response_format, JSONSchemaFormat)
        assert request.response_format.json_schema.json_schema == {"type": "object"}

    def test_known_openai_fields_we_do_not_act_on_are_accepted(self):
        body = chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto", seed=3)
        assert parse_request(ChatCompletionRequest, body).seed == 3

    def test_vllm_extensions(self):
        body = chat(top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2)
        request = parse_request(ChatCompletionRequest, body)
        assert (request.top_k, request.min_p, request.min_tokens) == (5, 0.1, 2)


# (body, param, code, words the message must contain)
CHAT_ERRORS = [
    (chat(temperature=2.5), "temperature", "invalid_value", "less than or equal to 2"),
    (chat(top_p=-0.1), "top_p", "invalid_value", "greater than or equal to 0"),
    (chat(n=0), "n", "invalid_value", "greater than or equal to 1"),
    (chat(max_token=5), "max_token", "unknown_parameter", "Unrecognized request argument"),
    (chat(priority=1001), "priority", "invalid_value", "less than or equal to 1000"),
    ({"messages": [USER]}, "model", "missing_required_parameter", "Missing required parameter"),
    ({"model": "m"}, "messages", "missing_required_parameter", "'messages'"),
    (chat(messages=[]), "messages", "invalid_value", "at least 1 item"),
    (
        chat(messages=[{"role": "robot", "content": "x"}]),
        "messages[0].role",
        "invalid_value",
        "robot",
    ),
    (chat(messages=[{"content": "x"}]), "messages[0].role", "invalid_value", "role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter", ""),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type", ""),
    (
        chat(messages=[{"role": "tool", "content": "x"}]),
        "messages[0].tool_call_id",
        "missing_required_parameter",
        "tool_call_id",
    ),
    (
        chat(messages=[USER, {"role": "user", "content": [{"type": "video"}]}]),
        "messages[1].content[0].type",
        "invalid_value",
        "video",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
        "messages[0].content[0].text",
        "invalid_type",
        "valid string",
    ),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value", "at most 4"),
    (chat(top_logprobs=2), "top_logprobs", "invalid_value", "requires logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value", "20"),
    (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value", "stream"),
    (chat(logit_bias={"abc": 1}), "logit_bias.abc", "invalid_type", "integer"),
    (chat(logit_bias={"5": 101}), "logit_bias.5", "invalid_value", "100"),
    (chat(response_format={"type": "xml"}), "response_format.type", "invalid_value", "xml"),
]


@pytest.mark.parametrize(("body", "param", "code", "words"), CHAT_ERRORS)
def test_chat_validation_errors_name_the_field(body, param, code, words):
    error = rejection(ChatCompletionRequest, body)
    assert error.status_code == 400
    assert error.body() == {
        "error": {
            "message": error.detail.message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }
    assert words in error.detail.message


def test_a_body_that_is_not_an_object_is_rejected_without_a_param():
    error = rejection(ChatCompletionRequest, ["not", "an", "object"])
    assert error.status_code == 400
    assert error.detail.param is None


class TestCompletionRequest:
    @pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
    def test_prompt_forms(self, prompt):
        assert parse_request(CompletionRequest, {"model": "m", "prompt": prompt}).prompt == prompt

    def test_defaults(self):
        request = parse_request(CompletionRequest, {"model": "m", "prompt": "x"})
        assert (request.max_tokens, request.logprobs, request.echo) == (16, None, False)

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"logprobs": 6}, "logprobs"),
            ({"prompt": []}, "prompt"),
            ({"prompt": [-1]}, "prompt[0]"),
            ({"best_of": 21}, "best_of"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"top_logprobs": 1}, "top_logprobs"),  # chat only
        ],
    )
    def test_errors(self, fields, param):
        error = rejection(CompletionRequest, {"model": "m", "prompt": "x", **fields})
        assert error.detail.param == param


class TestBatchLines:
    URLS = ("/v1/chat/completions", "/v1/completions")

    def line(self, **fields: Any) -> str:
        data = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions"}
        data["body"] = chat()
        return json.dumps({**data, **fields})

    def invalid(self, raw: str, checker: InputLineChecker | None = None) -> InvalidBatchLine:
        with pytest.raises(InvalidBatchLine) as caught:
            (checker or InputLineChecker(self.URLS)).check(raw, 7)
        return caught.value

    def test_a_valid_line(self):
        parsed = InputLineChecker(self.URLS).check(self.line(), 1)
        assert (parsed.custom_id, parsed.url, parsed.body) == ("r1", "/v1/chat/completions", chat())

    @pytest.mark.parametrize(
        ("raw", "code", "param"),
        [
            ("{not json", "invalid_json_line", None),
            ("[1, 2]", "invalid_json_line", None),
            (
                json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
                "missing_required_parameter",
                "custom_id",
            ),
            (
                json.dumps(
                    {"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {}}
                ),
                "invalid_type",
                "custom_id",
            ),
        ],
    )
    def test_malformed_lines(self, raw, code, param):
        error = self.invalid(raw).error
        assert (error.code, error.param, error.line) == (code, param, 7)

    @pytest.mark.parametrize(
        ("fields", "code", "param"),
        [
            ({"method": "GET"}, "invalid_method", "method"),
            ({"url": "/v1/embeddings"}, "invalid_url", "url"),
            ({"body": chat(stream=True)}, "stream_not_supported", "body.stream"),
        ],
    )
    def test_lines_a_batch_cannot_run_keep_their_custom_id(self, fields, code, param):
        failure = self.invalid(self.line(**fields))
        assert (failure.error.code, failure.error.param, failure.custom_id) == (code, param, "r1")

    def test_a_repeated_custom_id_is_refused(self):
        checker = InputLineChecker(self.URLS)
        checker.check(self.line(), 1)
        assert self.invalid(self.line(), checker).error.code == "duplicate_custom_id"
        checker.check(self.line(custom_id="r2"), 3)
