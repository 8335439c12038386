"""OpenAI's `response_format`, `tools` and `tool_choice` as the output they ask for: checked, a
ValueError naming the problem when wrong, else a grammar that holds a randomly initialised model
to well-formed tool calls (in the layout the chat template renders them) or to the schema."""

import json
import re
from collections.abc import Callable

import jsonschema
import pytest
import xgrammar as xgr

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.sample.structured_output import OutputLimits, StructuredOutput
from pagedbatch.protocol.structured_output import RequestedOutput, from_openai
from pagedbatch.protocol.tool_calls import ToolCall, parse_tool_calls

Matcher = Callable[[RequestedOutput], xgr.GrammarMatcher]

MAX_TOKENS = 1024
LIMITS = OutputLimits(max_string_length=16, max_items=4, max_number=10**6)  # quick to sample

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query", "filters"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
TOOLS = [WEATHER, SEARCH, NOW]
NAMES = ("get_weather", "search", "now")
ARGUMENTS = {
    tool["function"]["name"]: tool["function"].get("parameters", {"maxProperties": 0})
    for tool in TOOLS
}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, max_num_seqs=256)


@pytest.fixture(scope="module")
def matcher(llm) -> Matcher:
    """A fresh matcher for a request's output, compiled by the engine against its tokenizer."""
    grammars = llm.engine.grammars
    return lambda requested: xgr.GrammarMatcher(grammars.compile(requested.structured).result())


def sampled_calls(llm: LLM, requested: RequestedOutput, n: int) -> list[list[ToolCall]]:
    """The calls in n outputs to a prompt offering TOOLS, at temperature 1 with a seed each.

    Every output has ended by itself well within max_tokens and holds nothing but calls, each
    to one of the request's functions with arguments valid for its parameters.
    """
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = llm.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, seed=seed, structured=requested.structured)
        for seed in range(n)
    ]
    found = []
    for output in llm.generate([prompt] * n, params):
        assert output.finish_reason == "stop", output.text
        assert len(output.token_ids) < MAX_TOKENS // 2
        content, calls = parse_tool_calls(output.text)
        assert content is None and calls, output.text
        for call in calls:
            assert call.name in requested.tool_names
            jsonschema.validate(json.loads(call.arguments), ARGUMENTS[call.name])
        found.append(calls)
    return found


def test_required_tool_calls_name_declared_functions_with_valid_arguments(llm):
    requested = from_openai(tools=TOOLS, tool_choice="required", limits=LIMITS)
    assert requested.tool_names == NAMES
    counts = [len(calls) for calls in sampled_calls(llm, requested, n=200)]
    assert 1 < max(counts) <= LIMITS.max_items  # parallel calls happen, as many as allowed


def test_a_named_or_single_tool_call_is_exactly_one(llm):
    choice = {"type": "function", "function": {"name": "search"}}
    named = from_openai(tools=TOOLS, tool_choice=choice, limits=LIMITS)
    for calls in sampled_calls(llm, named, n=50):
        assert [call.name for call in calls] == ["search"]
    single = from_openai(
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, limits=LIMITS
    )
    for calls in sampled_calls(llm, single, n=50):
        assert len(calls) == 1


def test_auto_tool_choice_allows_text_and_enforces_calls(matcher):
    requested = from_openai(tools=TOOLS)  # auto, the default with tools
    auto = matcher(requested)
    assert auto.accept_string('Let me look. <tool_call>\n{"name": "now", "arguments": {}}\n')
    assert auto.accept_string("</tool_call> Done.")
    assert auto.is_completed()
    assert not matcher(requested).accept_string('<tool_call>\n{"name": "delete_everything"')
    bad_arguments = '<tool_call>\n{"name": "get_weather", "arguments": {"da'
    assert not matcher(requested).accept_string(bad_arguments)


def test_calls_are_held_to_the_layout_the_chat_template_renders(llm, matcher):
    calls = [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        {"name": "now", "arguments": "{}"},
    ]
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": call}
                for i, call in enumerate(calls)
            ],
        },
    ]
    rendered = llm.tokenizer.apply_chat_template(history, tokenize=False)
    written = re.search(r"<tool_call>.*</tool_call>", rendered, re.DOTALL).group()
    required = matcher(from_openai(tools=TOOLS, tool_choice="required"))
    assert required.accept_string(written) and required.is_completed()
    assert parse_tool_calls(written) == (None, [ToolCall(**call) for call in calls])


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "has space"}}},
            "json_schema.name",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "'x'"),
        ({"tool_choice": "required"}, "needs at least one tool"),
        ({"tools": [WEATHER, WEATHER]}, "more than once"),
        ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "only function tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "'f': parameters must be an object schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "not": {}},
                        },
                    }
                ]
            },
            "function 'f': unsupported JSON schema keyword 'not'",
        ),
    ],
)
def test_bad_openai_fields_are_refused_naming_the_problem(request_fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_openai(**request_fields)


def test_openai_fields_map_to_the_constraint_they_ask_for(matcher):
    assert from_openai() is None
    assert from_openai({"type": "text"}, TOOLS, "none") is None
    json_mode = from_openai({"type": "json_object"})
    assert json_mode == RequestedOutput(StructuredOutput.json_object())
    assert from_openai({"type": "json_object"}, TOOLS, "none") == json_mode
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    assert from_openai(schema) == RequestedOutput(StructuredOutput.json_schema(PERSON))
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "now"}}],
        },
    }
    assert from_openai(tools=TOOLS, tool_choice=allowed).tool_names == ("now",)
    # Auto with a response format: the answer follows the schema, or the model calls tools.
    answer_or_calls = from_openai(schema, TOOLS)
    assert answer_or_calls.tool_names == NAMES
    assert matcher(answer_or_calls).accept_string('{"name": "Al", "age": 3')
    assert matcher(answer_or_calls).accept_string('<tool_call>\n{"name": "now", ')
    assert not matcher(answer_or_calls).accept_string("Sure")
