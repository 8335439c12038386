"""Structured outputs through the API: `response_format` and tools become a grammar the engine
enforces, tool calls come back as `tool_calls`, whole or streamed, in realtime requests and batch
lines alike; bad schemas and tool choices are 400s before any engine work.

The checkpoint is random, so every well-formed output here is the grammar's doing."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from servers import BatchServer
from test_batches import chat_line, create, finished, read_lines
from test_realtime import MESSAGES, chat_prompt_ids, idle, stats
from test_serving import chat, generate

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.structured_output import from_openai
from pagedbatch.protocol.tool_calls import parse_tool_calls

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes no arguments
TOOLS = [WEATHER, NOW]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "now": {"maxProperties": 0}}


def person_format(strict: bool = True) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": strict},
    }


def assert_valid_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# The serving layer.


class TestRequests:
    def test_response_formats_and_tools_become_the_engine_constraint(self, engine):
        (plain,) = chat(engine).inputs
        assert plain.params.structured is None
        (constrained,) = chat(engine, response_format=person_format()).inputs
        assert constrained.params.structured == from_openai(person_format()).structured
        prepared = chat(engine, tools=TOOLS, tool_choice="required")
        assert prepared.calls_tools
        required = from_openai(tools=TOOLS, tool_choice="required")
        assert prepared.inputs[0].params.structured == required.structured

    def test_tool_choice_none_leaves_text_alone_but_still_shows_the_tools(self, engine):
        prepared = chat(engine, tools=TOOLS, tool_choice="none")
        assert not prepared.calls_tools and prepared.inputs[0].params.structured is None
        shown = engine.tokenizer.decode(prepared.inputs[0].prompt_token_ids)
        assert "<tools>" in shown and '"get_weather"' in shown

    def test_a_tool_call_history_renders_through_the_chat_template(self, engine):
        call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        messages = [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]
        (engine_input,) = chat(engine, messages=messages, tools=TOOLS).inputs
        shown = engine.tokenizer.decode(engine_input.prompt_token_ids)
        assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in shown
        assert "<tool_response>\n12:00\n</tool_response>" in shown

    @pytest.mark.parametrize(
        ("fields", "param", "words"),
        [
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}},
                        },
                    }
                },
                "response_format",
                "strnig",
            ),
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "strict": True,
                            "schema": {"type": "array", "contains": {"const": 1}},
                        },
                    }
                },
                "response_format",
                "contains",
            ),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
                "tool_choice",
                "rm",
            ),
            ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
            ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
            (
                {
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "array"}},
                        }
                    ]
                },
                "tools",
                "object schema",
            ),
            ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0]", "custom"),
            ({"functions": [{"name": "f"}]}, "functions", "use `tools`"),
            ({"response_format": person_format(), "min_tokens": 2}, None, "min_tokens"),
        ],
    )
    def test_bad_schemas_and_choices_are_400s_naming_the_field(self, engine, fields, param, words):
        with pytest.raises(OpenAIError) as caught:
            chat(engine, **fields)
        assert caught.value.status_code == 400
        assert caught.value.detail.param == param
        assert words in caught.value.detail.message

    def test_tool_calls_in_the_output_become_tool_calls_with_finish_reason(self, engine):
        prepared = chat(engine, tools=TOOLS, tool_choice="required", seed=1, temperature=1.0)
        (output,) = generate(engine, prepared)
        (choice,) = prepared.response([output]).choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        _, calls = parse_tool_calls(output.outputs[0].text)
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (c.name, c.arguments) for c in calls
        ]


# Realtime, through the SDK.


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Weather(BaseModel):
    city: str
    unit: Unit


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int
    alive: bool
    friends: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)


@pytest.mark.parametrize("storage", ["embedded"], indirect=True)
class TestRealtime:
    def test_sdk_parse_returns_the_pydantic_object(self, serve_batches):
        client = serve_batches().client()
        for seed in range(3):
            completion = client.chat.completions.parse(
                model="tiny",
                messages=MESSAGES,
                response_format=Person,
                temperature=1.0,
                seed=seed,
                max_completion_tokens=2000,
            )
            (choice,) = completion.choices
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, Person)

    def test_json_mode_gives_json_objects(self, serve_batches):
        client = serve_batches().client()
        completion = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_object"},
            n=4,
            temperature=1.0,
            seed=7,
            max_tokens=2000,
        )
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(json.loads(choice.message.content), dict)

    def test_greedy_constrained_output_equals_llm_generate(self, serve_batches, tiny_llama):
        server = serve_batches()
        completion = server.client().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format=person_format(),
            temperature=0.0,
            max_tokens=500,
        )
        text = completion.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)

        prompt = chat_prompt_ids(server, MESSAGES)
        params = SamplingParams(
            temperature=0.0, max_tokens=500, structured=from_openai(person_format()).structured
        )
        (direct,) = LLM(model=str(tiny_llama)).generate([prompt], params)
        assert text == direct.text

    def test_tool_calls_whole_streamed_and_through_the_sdk_helpers(self, serve_batches):
        server = serve_batches()
        client = server.client()
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=4)
        whole = client.chat.completions.create(**args, tool_choice="required", max_tokens=800)
        (choice,) = whole.choices
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls)

        chunks = list(
            client.chat.completions.create(
                **args, tool_choice="required", max_tokens=800, stream=True
            )
        )
        deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
        assert [d.index for d in deltas] == list(range(len(choice.message.tool_calls)))
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # The SDK's stream helper assembles the calls and parses the named tool's arguments.
        with client.chat.completions.stream(
            model="tiny",
            messages=MESSAGES,
            tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=5,
            max_tokens=800,
        ) as stream:
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Weather)
        assert idle(stats(server))

    def test_auto_tool_choice_streams_the_same_content_and_calls(self, serve_batches):
        client = serve_batches().client()
        for seed in range(4):
            args = dict(
                model="tiny",
                messages=MESSAGES,
                tools=TOOLS,
                seed=seed,
                max_tokens=60,
                temperature=1.0,
            )
            whole = client.chat.completions.create(**args).choices[0]
            chunks = list(client.chat.completions.create(**args, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert content == (whole.message.content or "")
            calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            assert len(calls) == len(whole.message.tool_calls or [])
            assert chunks[-1].choices[0].finish_reason == whole.finish_reason

    def test_bad_schemas_never_reach_the_engine(self, serve_batches):
        server = serve_batches()
        with pytest.raises(openai.BadRequestError) as caught:
            server.client().chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "minProperties": "two"},
                    },
                },
            )
        assert caught.value.body["param"] == "response_format"
        assert stats(server)["steps"] == 0


# Batch lines.


@pytest.mark.parametrize("storage", ["embedded"], indirect=True)
def test_batch_lines_get_schemas_and_tools_too(serve_batches):
    server: BatchServer = serve_batches()
    client = server.client()
    lines = [
        chat_line("json", max_tokens=2000, response_format=person_format(), temperature=1.0),
        chat_line("tools", max_tokens=800, tools=TOOLS, tool_choice="required", temperature=1.0),
        chat_line(
            "bad",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strnig"}},
            },
        ),
    ]
    batch = finished(client, create(client, lines).id)
    assert batch.status == "completed"
    out = {
        line["custom_id"]: line["response"]["body"]
        for line in read_lines(client, batch.output_file_id)
    }
    jsonschema.validate(json.loads(out["json"]["choices"][0]["message"]["content"]), PERSON)
    tools_choice = out["tools"]["choices"][0]
    assert tools_choice["finish_reason"] == "tool_calls"
    assert_valid_calls(
        openai.types.chat.ChatCompletionMessage.model_validate(tools_choice["message"]).tool_calls
    )
    (error,) = read_lines(client, batch.error_file_id)
    assert error["custom_id"] == "bad"
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "response_format"
