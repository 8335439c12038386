"""What a chat request's `response_format`, `tools` and `tool_choice` ask of its output, as the
engine's StructuredOutput (a grammar it enforces token by token) and the functions it may call.

The fields come as plain JSON, checked here before any engine work: a problem is a ValueError
naming it, which the API answers with a 400. Tool calls take the shape of tool_calls.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedbatch.engine.sample.grammar_runtime import too_costly
from pagedbatch.engine.sample.structured_output import OutputLimits, StructuredOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.tool_calls import TOOL_CALL_OPENING, call_tag, calls_in_a_row

_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
DEFAULT_LIMITS = OutputLimits()


@dataclass(frozen=True)
class RequestedOutput:
    """The constraint on a request's output, and the functions it may call (none: the output
    holds no tool calls, and its text is returned as it is)."""

    structured: StructuredOutput
    tool_names: tuple[str, ...] = ()


def from_openai(
    response_format: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    limits: OutputLimits = DEFAULT_LIMITS,
) -> RequestedOutput | None:
    """The output an OpenAI chat request asks for (fields as plain JSON), or None for any text.

    Raises ValueError naming the problem.
    """
    answer = _response_format(response_format or {"type": "text"}, limits)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, Mapping):
        tools, choice = _resolve_choice(choice, tools or [])
    elif choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {choice!r}")
    if choice == "none" or (choice == "auto" and not tools):
        return None if answer is None else RequestedOutput(answer)
    if not tools:
        raise ValueError(f"tool_choice {choice!r} needs at least one tool")
    return _tool_calls(tools, choice, parallel_tool_calls, answer, limits)


def _response_format(form: Mapping[str, Any], limits: OutputLimits) -> StructuredOutput | None:
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(limits)
    if kind != "json_schema":
        raise ValueError(f"response_format type must be text, json_object or json_schema: {kind!r}")
    spec = form.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format json_schema needs a json_schema object")
    if not _FUNCTION_NAME.match(str(spec.get("name", ""))):
        raise ValueError("response_format json_schema.name must be 1-64 of a-z, A-Z, 0-9, _ and -")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutput.json_object(limits)
    return StructuredOutput.json_schema(schema, bool(spec.get("strict")), limits)


def _resolve_choice(
    choice: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]
) -> tuple[list[Mapping[str, Any]], str]:
    """A named or allowed-tools choice as (the tools it leaves, a plain choice)."""
    kind = choice.get("type")
    if kind == "function":
        name = (choice.get("function") or {}).get("name")
        return list(tools), str(name)
    if kind == "allowed_tools":
        allowed = choice.get("allowed_tools") or {}
        names = {(t.get("function") or {}).get("name") for t in allowed.get("tools") or []}
        declared = {(t.get("function") or {}).get("name") for t in tools}
        if unknown := sorted(str(n) for n in names - declared):
            raise ValueError(f"tool_choice allowed_tools names functions not in tools: {unknown}")
        if allowed.get("mode") not in ("auto", "required"):
            raise ValueError("tool_choice allowed_tools.mode must be auto or required")
        kept = [t for t in tools if (t.get("function") or {}).get("name") in names]
        return kept, allowed["mode"]
    raise ValueError(f"tool_choice type must be function or allowed_tools, got {kind!r}")


def _tool_calls(
    tools: Sequence[Mapping[str, Any]],
    choice: str,
    parallel: bool,
    answer: StructuredOutput | None,
    limits: OutputLimits,
) -> RequestedOutput:
    """Tool calls to OpenAI function `tools` ({"type": "function", "function": {...}}).

    `choice`: "auto" (text, or `answer` when given, or tool calls), "required" (one or more
    calls, nothing else) or a function's name (exactly one call to it). `parallel` allows up to
    `limits.max_items` calls in one turn.
    """
    functions = _functions(tools)
    names = tuple(f["name"] for f in functions)
    named = choice not in ("auto", "required")
    if named and choice not in names:
        raise ValueError(f"tool_choice names function {choice!r}, which is not in tools")
    tags = [
        call_tag(f["name"], _arguments(f, limits))
        for f in functions
        if not named or f["name"] == choice
    ]
    call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    calls = calls_in_a_row(call, limits.max_items if parallel else 1)
    if named:
        form = call
    elif choice == "required":
        form = calls
    elif answer is not None:
        form = {"type": "or", "elements": [{"type": "grammar", "grammar": answer.grammar}, calls]}
    else:
        # Free text until the model opens a call; the call itself is then enforced.
        form = {
            "type": "triggered_tags",
            "triggers": [TOOL_CALL_OPENING],
            "tags": tags,
            "stop_after_first": not parallel,
        }
    return RequestedOutput(StructuredOutput.structural_tag(form), tool_names=names)


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    functions = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f"tools[{i}]: only function tools are supported")
        function = tool["function"]
        if not _FUNCTION_NAME.match(str(function.get("name", ""))):
            raise ValueError(f"tools[{i}]: function name must be 1-64 of a-z, A-Z, 0-9, _ and -")
        functions.append(function)
    names = [f["name"] for f in functions]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"tools declare these functions more than once: {duplicated}")
    if not functions:
        raise ValueError("tools must declare at least one function")
    return functions


def _arguments(function: Mapping[str, Any], limits: OutputLimits) -> StructuredOutput:
    # OpenAI: leaving out `parameters` declares a function that takes no arguments.
    schema = function.get("parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError(f"function {function['name']!r}: parameters must be an object schema")
    try:
        return StructuredOutput.json_schema(schema, bool(function.get("strict")), limits)
    except ValueError as e:
        raise ValueError(f"function {function['name']!r}: {e}") from None


def costly_output_format(engine_error: str | None) -> OpenAIError | None:
    """The 400 of a request whose grammar took longer to compile than the engine allows (a
    request's `RequestOutput.error`), naming response_format; None for any other error."""
    if not too_costly(engine_error):
        return None
    reason = engine_error.partition(": ")[2] or engine_error
    return OpenAIError(
        f"Invalid 'response_format': {reason}.",
        param="response_format",
        code="response_format_too_costly",
    )
