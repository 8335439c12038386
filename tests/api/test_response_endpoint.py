"""The Responses API through the unmodified `openai` SDK against the embedded service: plain and
with instructions, function tools round trip, `text.format` and `responses.parse`, streaming,
as batch lines; greedy output is chat's for the same conversation, token for token; bad input
is a 400 naming the field.

The checkpoint is random: every well-formed call or JSON here is the grammar's doing."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field
from test_batches import create, finished, read_lines

from pagedbatch.run_batch import run_batch

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
GREEDY = {"temperature": 0, "max_output_tokens": 16}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=130)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], **body: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=16, **body
    )


def test_create_answers_as_chat_does_for_the_same_conversation(serve_batches):
    client = serve_batches().client()
    plain = client.responses.create(model="tiny", input="Hello there", **GREEDY)
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.status == "incomplete"  # a random model runs on to max_output_tokens
    assert plain.incomplete_details.reason == "max_output_tokens"
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    chat = chat_text(client, [{"role": "user", "content": "Hello there"}])
    assert plain.output_text == chat.choices[0].message.content
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
    assert plain.usage.output_tokens == chat.usage.completion_tokens == 16
    assert plain.usage.total_tokens == chat.usage.total_tokens
    assert plain.usage.output_tokens_details.reasoning_tokens == 0

    # Instructions are a system message first; items are the messages after it.
    instructed = client.responses.create(
        model="tiny",
        instructions="Answer in French.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        ],
        **GREEDY,
    )
    chat = chat_text(
        client,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Go"},
        ],
    )
    assert instructed.instructions == "Answer in French."
    assert instructed.output_text == chat.choices[0].message.content
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens
    assert instructed.output_text != plain.output_text


def test_function_tools_round_trip_with_function_call_output(serve_batches):
    client = serve_batches().client()
    called = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY | {"max_output_tokens": 64},
    )
    assert called.status == "completed"
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert called.tools[0].name == "get_weather" and called.tool_choice == "required"

    # The call and its output go back as items; the model answers in text.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in called.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    answered = client.responses.create(model="tiny", input=history, tools=[WEATHER], **GREEDY)
    assert answered.output[0].type == "message"
    chat = chat_text(
        client,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
    )
    assert answered.output_text == chat.choices[0].message.content


def test_text_format_json_schema_and_parse(serve_batches):
    client = serve_batches().client()
    schema = Person.model_json_schema() | {"additionalProperties": False}
    formatted = client.responses.create(
        model="tiny",
        input="Who?",
        text={"format": {"type": "json_schema", "name": "who", "schema": schema, "strict": True}},
        max_output_tokens=200,
    )
    assert formatted.status == "completed"
    Person.model_validate_json(formatted.output_text)
    assert formatted.text.format.type == "json_schema"

    parsed = client.responses.parse(
        model="tiny", input="Who?", text_format=Person, max_output_tokens=200
    )
    assert isinstance(parsed.output_parsed, Person)


# Each request's fault, and the field its 400 names.
BAD_BODIES = [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "code_interpreter", "container": "auto"}]}, "tools[1]"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}},
        "text.format",
    ),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        "input[0].content[0].type",
    ),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"max_output_tokens": 15}, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"include": ["everything"]}, "include[0]"),
    ({"extra_body": {"max_tokens": 16}}, "max_tokens"),
]


def test_bad_input_is_a_400_naming_the_field(serve_batches):
    client = serve_batches().client()
    for body, param in BAD_BODIES:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{"model": "tiny", "input": "Hi", **GREEDY, **body})
            pytest.fail(f"{body} was answered")
        assert caught.value.body["param"] == param, (body, caught.value.body)
    # Nothing else was disturbed: the next good request is answered.
    assert client.responses.create(model="tiny", input="Hi", **GREEDY).output_text


def event_types(events: list[Any]) -> list[str]:
    return [event.type for event in events]


def test_a_stream_tells_the_response_in_typed_events(serve_batches):
    client = serve_batches().client()
    events = list(client.responses.create(model="tiny", input="Hello there", stream=True, **GREEDY))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = event_types(events)
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut at max_output_tokens
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    whole = client.responses.create(model="tiny", input="Hello there", **GREEDY)
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens == 16

    # The SDK's stream helpers: a JSON answer that completes, parsed.
    with client.responses.stream(
        model="tiny", input="Who?", text_format=Person, max_output_tokens=200
    ) as stream:
        streamed = list(stream)
        parsed = stream.get_final_response()
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    joined = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert joined == parsed.output_text
    assert event_types(streamed)[-1] == "response.completed"

    # Function calls: their own items and argument events, after the (empty) text.
    with client.responses.stream(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY | {"max_output_tokens": 64},
    ) as stream:
        called = list(stream)
        final = stream.get_final_response()
    types = event_types(called)
    assert types[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final.output
    assert call.type == "function_call" and call.call_id == called[2].item.call_id
    assert call.arguments == called[3].delta == called[4].arguments
    json.loads(call.arguments)


RESPONSE_BODIES = {
    "plain": {"input": "Hello there"},
    "instructed": {"instructions": "Be terse.", "input": [{"role": "user", "content": "Hi"}]},
    "called": {
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
    },
    "refused": {"input": "Search", "tools": [{"type": "web_search"}]},
}


def response_lines() -> list[dict[str, Any]]:
    return [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "tiny", **GREEDY | body},
        }
        for name, body in RESPONSE_BODIES.items()
    ]


def said(response: dict[str, Any]) -> list[tuple[str, str]]:
    """What a Response's output says, less its fresh ids."""
    return [
        (item["type"], item["content"][0]["text"] if item["type"] == "message" else item["name"])
        for item in response["output"]
    ] + [(item["name"], item["arguments"]) for item in response["output"] if "arguments" in item]


def test_a_batch_of_responses_lines_equals_the_requests_one_by_one(
    serve_batches, tiny_llama, tmp_path
):
    server = serve_batches()
    client = server.client()
    batch = finished(client, create(client, response_lines(), endpoint="/v1/responses").id)
    assert batch.status == "completed", batch.errors
    written = read_lines(client, batch.output_file_id) + read_lines(client, batch.error_file_id)
    lines = {line["custom_id"]: line for line in written}

    refused = lines.pop("refused")["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "tools[0]"
    for name, line in lines.items():
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "response"
        one = client.responses.create(model="tiny", **GREEDY | RESPONSE_BODIES[name])
        assert said(body) == said(one.model_dump()), name
        # Cached tokens may differ: the prefix cache holds what ran before.
        used = body["usage"]
        assert (used["input_tokens"], used["output_tokens"], used["total_tokens"]) == (
            one.usage.input_tokens,
            one.usage.output_tokens,
            one.usage.total_tokens,
        )
    assert lines["called"]["response"]["body"]["output"][0]["type"] == "function_call"

    # run-batch takes the same lines.
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in response_lines()) + "\n")
    run_batch(source, target, tiny_llama, show_progress=False, served_model_name="tiny")
    offline = {
        line["custom_id"]: line["response"]
        for line in map(json.loads, target.read_text().splitlines())
    }
    assert offline.pop("refused")["status_code"] == 400
    for name, line in lines.items():
        assert said(offline[name]["body"]) == said(line["response"]["body"]), name
