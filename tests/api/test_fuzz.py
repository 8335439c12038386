"""Hostile requests against a live embedded server: nothing may get a 5xx or break the service.

Every field of `POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses`
(whole and streamed), of `POST /v1/files` uploads (the multipart envelope and the batch lines
inside) and of `POST /v1/batches`, and the lines of batches run to the end, get values a careless
parser trips on: integers past 64 bits, strings of hundreds of KB, nesting hundreds to thousands
deep, lone surrogates, NUL, overlong and invalid UTF-8, NaN and Infinity literals, wrong types,
thousands of stop strings, `n` 128 over many prompts. Each response must be an OpenAI-shaped
error with a 4xx status (a 503 only with a code docs/api.md documents) or a success that parses
as the documented object, within a minute (the tiny model answers any of these in seconds); a
stream must end in `[DONE]` or a client error event, a Responses stream in
`response.completed`, `.incomplete` or `.failed`, its typed events numbered in order and no error
the server's; a batch must end, and no line of its output or error file may hold a 5xx.
Afterwards the same server must still answer a plain chat request, a response, `/health` and a
plain batch.

Values are hand-written Hypothesis strategies set into an otherwise valid body, one or two fields
at a time, so that each reaches the check it targets instead of an earlier one; schemathesis'
schema-driven bodies from the app's own `/openapi.json` serve as further valid bases. The run is
derandomized (the same examples every run) and collects every failure, with the server's
traceback, before it fails, so that one run reports them all.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from pydantic import BaseModel, ValidationError
from schemathesis import Case
from schemathesis.schemas import APIOperation
from servers import BatchServer

from pagedbatch.api.batches.schemas import BatchCreate, BatchObject
from pagedbatch.api.files.schemas import FileObject
from pagedbatch.protocol.batch_lines import BatchOutputLine
from pagedbatch.protocol.errors import ErrorResponse
from pagedbatch.protocol.schemas.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
)
from pagedbatch.protocol.schemas.completions import Completion, CompletionRequest
from pagedbatch.protocol.schemas.responses import Response, ResponseCreateRequest

MODEL = "tiny"
REQUEST_TIMEOUT_SECONDS = 60.0  # a request the tiny model cannot answer in this is a hang
BATCH_TIMEOUT_SECONDS = 90.0
# Statuses at or above 500 docs/api.md documents, by error code: no engine for the model.
DOCUMENTED_5XX = {503: {"engine_unavailable"}}
TERMINAL = {"completed", "failed", "cancelled", "expired"}

# Examples per area, sized so that the whole module runs in about 1-2 minutes on two cores.
REALTIME_EXAMPLES = 250
RESPONSES_EXAMPLES = 120
SCHEMA_EXAMPLES = 40
UPLOAD_EXAMPLES = 60
BATCH_CREATE_EXAMPLES = 50
BATCH_RUNS = 6

FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples every run: a CI failure reproduces locally
    database=None,
    # Shrinking replays requests for minutes; failures are collected as found instead.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


# ---------------------------------------------------------------------------------------------
# Hostile JSON values, and an encoder that writes what json.dumps refuses to.


@dataclass(frozen=True)
class Raw:
    """JSON text (or not quite JSON) put into a body as it is."""

    text: bytes

    def __repr__(self) -> str:
        shown = self.text[:40] + (b"..." if len(self.text) > 40 else b"")
        return f"Raw({shown!r}, {len(self.text)} bytes)"


def encode(value: Any) -> bytes:
    """`value` as JSON bytes: NaN and Infinity as bare literals, a lone surrogate as its `\\ud800`
    escape (ensure_ascii), `Raw` text as it is, in keys too."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (
            encode(k if isinstance(k, Raw) else str(k)) + b":" + encode(v) for k, v in value.items()
        )
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list | tuple):
        return b"[" + b",".join(encode(v) for v in value) + b"]"
    return json.dumps(value, allow_nan=True).encode()


def nested(depth: int, opening: bytes, core: bytes, closing: bytes) -> Raw:
    return Raw(opening * depth + core + closing * depth)


DEPTHS = [300, 1_000, 20_000]
HUGE = 300_000  # characters: a few hundred KB per string, as large as the test's time allows

EXTREME_INTEGERS: list[Any] = [
    2**63,
    -(2**63),
    2**63 - 1,
    2**64,
    10**30,
    -(10**30),
    -1,
    0,
    2**31,
    2**31 - 1,  # the bound the API puts on counts: accepted, so it reaches the engine
    -(2**31),
    2**53 + 1,  # past what a double holds exactly
    Raw(b"9" * 5_000),  # past Python's 4,300-digit int parsing limit
    Raw(b"1e400"),  # a float past double range
    Raw(b"-0"),
]
FLOATS: list[Any] = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 0.5, -0.0]
BAD_STRINGS: list[Any] = [
    "",
    "a" * HUGE,
    "\x00",
    "a\x00b",
    "\ud800",  # lone surrogates: sent as JSON escapes, unpaired
    "\udfff\ud800",
    "x\udbff",
    Raw(b'"\xc0\xaf"'),  # an overlong encoding of "/"
    Raw(b'"\xff\xfe\xfd"'),  # bytes that are no UTF-8 at all
    Raw(b'"\xed\xa0\x80"'),  # a surrogate encoded in UTF-8
    "\u202e\u200b\ufeff",
    "\U0001d54f" * 10_000,
    "\n" * 10_000,
    "<|endoftext|><|im_start|><s></s>",
    "9223372036854775808",
    "NaN",
    "null",
]
WRONG_TYPES: list[Any] = [
    True,
    False,
    None,
    [],
    {},
    [None],
    {"": None},
    [[[]]],
    [0] * 50_000,
    ["stop"] * 5_000,
]
DEEP: list[Any] = [
    v
    for d in DEPTHS
    for v in (
        nested(d, b"[", b"1", b"]"),
        nested(d, b'{"a":', b"1", b"}"),
        nested(d, b'[{"type":"text","text":', b'"x"', b"}]"),
    )
]

hostile_scalars: SearchStrategy[Any] = st.sampled_from(
    EXTREME_INTEGERS + FLOATS + BAD_STRINGS + WRONG_TYPES + DEEP
)
small_scalars: SearchStrategy[Any] = st.sampled_from(
    EXTREME_INTEGERS[:-3] + FLOATS + BAD_STRINGS[2:7] + WRONG_TYPES[:8]
)
hostile_keys: SearchStrategy[Any] = st.sampled_from(
    ["", "a" * 100_000, "\x00", "\ud800", Raw(b'"\xff"'), "9223372036854775808", "-1", "1e30"]
)
# Wrong shapes built of small hostile parts: a dict where a string goes, and so on.
hostile_structures: SearchStrategy[Any] = st.recursive(
    small_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "text", "role", "a", "\x00"]), children, max_size=3
        )
    ),
    max_leaves=8,
)
# Values many fields accept, at or near their bounds: they pass the checks and reach the engine.
edge_values: SearchStrategy[Any] = st.sampled_from(
    [0, 1, 2, 5, 20, 128, 256, 2**31 - 1, -2, 2.0, 1e-300, True, False, "auto", "none", "required"]
)
hostile_values: SearchStrategy[Any] = st.one_of(hostile_scalars, hostile_structures, edge_values)

# JSON schemas for structured output and tool parameters that a grammar compiler trips on.
HOSTILE_SCHEMAS: list[Any] = [
    *(
        v
        for d in DEPTHS
        for v in (
            nested(d, b'{"type":"object","properties":{"a":', b'{"type":"string"}', b"}}"),
            nested(d, b'{"type":"array","items":', b'{"type":"integer"}', b"}"),
            nested(d, b'{"anyOf":[', b'{"type":"null"}', b"]}"),
        )
    ),
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # a reference cycle
    {"$ref": "#/nowhere"},
    {"$ref": "http://127.0.0.1:1/schema.json"},
    {"anyOf": [{"const": i} for i in range(5_000)]},
    {"type": "string", "pattern": "(a+)+" * 200},
    {"type": "string", "pattern": "["},
    {"type": "string", "minLength": 2**63, "maxLength": -1},
    {"type": "integer", "minimum": 10**30, "maximum": -(10**30)},
    {"type": "array", "minItems": 2**64, "items": {"type": "integer"}},
    {"type": "array", "minItems": 100_000, "items": {"type": "integer"}},
    {"enum": []},
    {"type": "nonsense"},
    {"type": ["string", 1, None]},
    {"not": {}},
    {"format": "\x00", "type": "string"},
]
# 60 KB of optional properties: slow to compile into a grammar. Sent once, among FIXED_CASES,
# rather than drawn, so that while it is slow it costs the test one timeout.
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2_000)}}
schema_values: SearchStrategy[Any] = st.one_of(st.sampled_from(HOSTILE_SCHEMAS), hostile_values)


# ---------------------------------------------------------------------------------------------
# Bodies: a valid base with hostile values set at one or two paths.

GENERATION_FIELDS = (
    "n",
    "best_of",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Target:
    """A place in a body to put a hostile value; `base` makes the rest of the body around it
    valid (a nested path needs its parents)."""

    path: Path
    values: SearchStrategy[Any] = hostile_values
    base: dict[str, Any] = field(default_factory=dict)


JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "out", "schema": {"type": "object"}},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def top_level_targets(model: type[BaseModel]) -> list[Target]:
    """Every field of a request model (so a new field is fuzzed too), and one it lacks."""
    names = [info.alias or name for name, info in model.model_fields.items()]
    return [Target((name,)) for name in [*names, "unknown_field"]]


SHARED_TARGETS = [
    Target(("logit_bias",), st.builds(lambda k, v: {k: v}, hostile_keys, hostile_values)),
    Target(("logit_bias", "9223372036854775808"), st.sampled_from([1, 100, -100])),
    Target(("logit_bias", "-1"), st.sampled_from([1, 100, math.nan])),
    Target(("stop",), st.sampled_from([["s"] * 5_000, [str(i) for i in range(5_000)]])),
    Target(("stream_options", "include_usage"), base={"stream": True}),
    Target(("stream_options",), base={"stream": True}),
]
CHAT_TARGETS = [
    *top_level_targets(ChatCompletionRequest),
    *SHARED_TARGETS,
    Target(("messages", 0, "content")),
    Target(("messages", 0, "role")),
    Target(("messages", 0, "name")),
    Target(("messages", 0, "content", 0, "text")),
    Target(("messages", 0, "content", 0, "image_url", "url")),
    Target(("messages", 1)),
    Target(("messages",), st.sampled_from([[{"role": "user", "content": "x"}] * 5_000])),
    Target(
        ("response_format", "json_schema", "schema"),
        schema_values,
        {"response_format": JSON_SCHEMA_FORMAT},
    ),
    Target(
        ("response_format", "json_schema", "name"), base={"response_format": JSON_SCHEMA_FORMAT}
    ),
    Target(
        ("response_format", "json_schema", "strict"), base={"response_format": JSON_SCHEMA_FORMAT}
    ),
    Target(("response_format", "type")),
    Target(("tools", 0, "function", "parameters"), schema_values, {"tools": [TOOL]}),
    Target(("tools", 0, "function", "name"), base={"tools": [TOOL]}),
    Target(("tools", 0, "function", "strict"), base={"tools": [TOOL], "tool_choice": "required"}),
    Target(("tool_choice",), base={"tools": [TOOL]}),
    Target(
        ("tool_choice", "function", "name"),
        base={"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ),
    Target(("top_logprobs",), base={"logprobs": True}),
]
COMPLETION_TARGETS = [
    *top_level_targets(CompletionRequest),
    *SHARED_TARGETS,
    Target(("prompt", 0)),
    Target(("prompt", 0, 0)),
    Target(("prompt",), st.sampled_from([[2**63], [-1], [10**30], [[0] * 5_000], [[]], [""]])),
    Target(("echo",), base={"logprobs": 5}),
]
RESPONSE_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSE_FORMAT = {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}}
RESPONSE_ITEMS = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
RESPONSE_TARGETS = [
    *top_level_targets(ResponseCreateRequest),
    Target(("input", 0, "type"), base=RESPONSE_ITEMS),
    Target(("input", 0, "role"), base=RESPONSE_ITEMS),
    Target(("input", 0, "content"), base=RESPONSE_ITEMS),
    Target(("input", 0, "content", 0, "type"), base=RESPONSE_ITEMS),
    Target(("input", 0, "content", 0, "text"), base=RESPONSE_ITEMS),
    Target(("input", 0, "content", 0, "image_url"), base=RESPONSE_ITEMS),
    Target(("input", 0, "content", 0, "file_data"), base=RESPONSE_ITEMS),
    Target(("input", 1), base=RESPONSE_ITEMS),
    Target(
        ("input", 0, "output"), base={"input": [{"type": "function_call_output", "call_id": "c"}]}
    ),
    Target(("input", 0, "arguments"), base={"input": [{"type": "function_call", "call_id": "c"}]}),
    Target(("input",), st.sampled_from([[{"role": "user", "content": "x"}] * 5_000])),
    Target(("tools", 0, "parameters"), schema_values, {"tools": [RESPONSE_TOOL]}),
    Target(("tools", 0, "type"), base={"tools": [RESPONSE_TOOL]}),
    Target(("tools", 0, "name"), base={"tools": [RESPONSE_TOOL]}),
    Target(("tool_choice",), base={"tools": [RESPONSE_TOOL]}),
    Target(("tool_choice", "name"), base={"tools": [RESPONSE_TOOL]}),
    Target(("text", "format", "schema"), schema_values, {"text": RESPONSE_FORMAT}),
    Target(("text", "format", "name"), base={"text": RESPONSE_FORMAT}),
    Target(("text", "format", "type")),
    Target(("metadata",), st.builds(lambda k, v: {k: v}, hostile_keys, hostile_values)),
    Target(("include", 0)),
    Target(("reasoning", "effort")),
]
RESPONSES_BASE = {"model": MODEL, "input": "Hi", "max_output_tokens": 16}
CHAT_BASE = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    "max_completion_tokens": 2,
}
COMPLETION_BASE = {"model": MODEL, "prompt": ["Hi"], "max_tokens": 2}


def set_path(body: Any, path: Path, value: Any) -> Any:
    """`body` with `value` at `path`; the containers on the way are made or replaced as needed
    (an index past a list's end appends)."""
    if not path:
        return value
    step, rest = path[0], path[1:]
    if isinstance(step, int):
        items = list(body) if isinstance(body, list) else []
        if step < len(items):
            items[step] = set_path(items[step], rest, value)
        else:
            items.append(set_path({}, rest, value))
        return items
    mapping = dict(body) if isinstance(body, dict) else {}
    mapping[step] = set_path(mapping.get(step, {}), rest, value)
    return mapping


def _group(target: Target) -> Path | str:
    # At most one field that multiplies the work per body: n=128 with max_tokens=2**31-1 is a
    # legitimately slow request, not a finding, and would take the test's time.
    return "generation" if target.path[0] in GENERATION_FIELDS else target.path


def hostile_bodies(base: dict[str, Any], targets: list[Target]) -> SearchStrategy[dict[str, Any]]:
    """`base` with one or two targets given hostile values."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        chosen = draw(st.lists(st.sampled_from(targets), min_size=1, max_size=2, unique_by=_group))
        body = dict(base)
        for target in chosen:
            body.update(target.base)
        for target in chosen:
            body = set_path(body, target.path, draw(target.values))
        return body

    return build()


# Bodies that are not a request at all, or whose JSON is broken.
WHOLE_BODIES: list[bytes] = [
    b"",
    b"null",
    b"NaN",
    b"[]",
    b'"\\ud800"',
    b"\xff\xfe{}",
    b'{"model": "tiny", "model": 1}',
    b'{"model": "tiny"',
    b"{" * 100_000,
    *(nested(d, b"[", b"", b"]").text for d in DEPTHS),
    *(nested(d, b'{"a":', b"1", b"}").text for d in DEPTHS),
    b'{"\\ud800": 1, "model": "tiny"}',
    b" " * HUGE + b"{}",
]

# Always sent, whatever Hypothesis draws: the cases the issue names, and values at the edge of
# what the API accepts, which pass its checks and so reach the engine.
LARGEST = 2**31 - 1
FIXED_CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {**COMPLETION_BASE, "top_k": 9223372036854775808}),
    ("/v1/chat/completions", {**CHAT_BASE, "top_k": 9223372036854775808}),
    ("/v1/completions", {**COMPLETION_BASE, "top_k": LARGEST, "temperature": 2}),
    ("/v1/completions", {**COMPLETION_BASE, "n": 128, "prompt": [f"p{i}" for i in range(128)]}),
    ("/v1/completions", {**COMPLETION_BASE, "n": 128, "prompt": ["a", "b"], "stream": True}),
    ("/v1/completions", {**COMPLETION_BASE, "best_of": 20, "n": 20, "prompt": ["x"] * 64}),
    ("/v1/completions", {**COMPLETION_BASE, "best_of": 20, "n": 1, "prompt": ["x"] * 12}),
    ("/v1/chat/completions", {**CHAT_BASE, "n": 128, "stream": True}),
    ("/v1/chat/completions", {**CHAT_BASE, "logit_bias": {str(2**64): 1, "-1": -100, "1e30": 5}}),
    ("/v1/chat/completions", {**CHAT_BASE, "logit_bias": {str(LARGEST): 100}}),
    ("/v1/chat/completions", {**CHAT_BASE, "logit_bias": {str(i): -100 for i in range(10_000)}}),
    ("/v1/chat/completions", {**CHAT_BASE, "stop": ["s"] * 5_000}),
    ("/v1/chat/completions", {**CHAT_BASE, "stop": ["s" * (HUGE // 4)] * 4}),
    ("/v1/completions", {**COMPLETION_BASE, "max_tokens": 2**63, "prompt": "x" * HUGE}),
    ("/v1/completions", {**COMPLETION_BASE, "prompt": "<|endoftext|>" * 10_000}),
    ("/v1/chat/completions", {**CHAT_BASE, "max_completion_tokens": 2**63 - 1}),
    ("/v1/chat/completions", {**CHAT_BASE, "max_completion_tokens": LARGEST, "stream": True}),
    ("/v1/completions", {**COMPLETION_BASE, "seed": 2**64, "temperature": 2}),
    ("/v1/completions", {**COMPLETION_BASE, "seed": -(2**63) - 1}),
    ("/v1/completions", {**COMPLETION_BASE, "seed": 2**63 - 1, "n": 4}),
    ("/v1/completions", {**COMPLETION_BASE, "min_tokens": 2**63, "max_tokens": 2}),
    ("/v1/completions", {**COMPLETION_BASE, "min_tokens": LARGEST, "max_tokens": 2}),
    ("/v1/completions", {**COMPLETION_BASE, "logprobs": 5, "echo": True, "prompt": [[2**31]]}),
    ("/v1/completions", {**COMPLETION_BASE, "logprobs": 5, "echo": True, "prompt": [[0] * 2_047]}),
    ("/v1/completions", {**COMPLETION_BASE, "max_tokens": 1, "prompt": [[0] * 2_048]}),
    ("/v1/completions", {**COMPLETION_BASE, "suffix": "\ud800", "echo": True}),
    ("/v1/chat/completions", {**CHAT_BASE, "logprobs": True, "top_logprobs": 20, "n": 10}),
    ("/v1/chat/completions", {**CHAT_BASE, "messages": [{"role": "user", "content": "x"}] * 5_000}),
    ("/v1/chat/completions", {**CHAT_BASE, "tools": [TOOL] * 1_000, "tool_choice": "required"}),
    (
        "/v1/chat/completions",
        {
            **CHAT_BASE,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": HOSTILE_SCHEMAS[0]},
            },
        },
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT_BASE,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "wide", "schema": WIDE_SCHEMA},
            },
        },
    ),
    # Echoed in the error message: the error must still be written as JSON.
    ("/v1/chat/completions", {**CHAT_BASE, "model": "x\ud800"}),
    ("/v1/completions", {**COMPLETION_BASE, "\udfff": 1}),
    ("/v1/chat/completions", {**CHAT_BASE, "messages": [{"role": "\ud800", "content": "x"}]}),
    ("/v1/chat/completions", {**CHAT_BASE, "repetition_penalty": 5e-324, "temperature": 2}),
    ("/v1/chat/completions", {**CHAT_BASE, "frequency_penalty": 2, "presence_penalty": -2}),
    ("/v1/chat/completions", {**CHAT_BASE, "min_p": 1, "top_p": 5e-324}),
]


# ---------------------------------------------------------------------------------------------
# Judging responses


@dataclass
class Failure:
    where: str
    payload: bytes
    status: int | None
    problem: str
    server_log: list[str]

    def kind(self) -> tuple[str, int | None, str, frozenset[str]]:
        """What tells one bug from another: the same kind shows up with many payloads."""
        raised = frozenset(re.findall(r"\b\w+(?:Error|Exception)\b", " ".join(self.server_log)))
        return self.where, self.status, self.problem[:100], raised

    def __str__(self) -> str:
        shown = self.payload[:300] + (b"..." if len(self.payload) > 300 else b"")
        log = "\n    ".join(self.server_log) or "(nothing logged)"
        return (
            f"{self.where} -> {self.status}: {self.problem}\n  payload ({len(self.payload)} "
            f"bytes): {shown!r}\n  server log:\n    {log}"
        )


def report(failures: list[Failure]) -> str:
    """Failures grouped by kind, each with its smallest payloads."""
    kinds: dict[tuple[str, int | None, str, frozenset[str]], list[Failure]] = {}
    for failure in failures:
        kinds.setdefault(failure.kind(), []).append(failure)
    parts = [f"{len(failures)} failures of {len(kinds)} kinds:"]
    for i, same in enumerate(kinds.values(), 1):
        same.sort(key=lambda f: len(f.payload))
        parts.append(f"--- kind {i}: {len(same)} payloads, the smallest:")
        parts += [str(f) for f in same[:2]]
    return "\n".join(parts)


class ServerLog(logging.Handler):
    """What the in-process server logs at ERROR or above, with each traceback's last lines."""

    LOGGERS = ("", "uvicorn")  # uvicorn's loggers do not propagate to the root

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record is self._last:  # reached through two loggers
            return
        self._last = record
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            frames = traceback.extract_tb(exc.__traceback__)[-3:]
            where = " <- ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(frames))
            text += f" | {type(exc).__name__}: {exc} | at {where}"
        self.lines.append(text[:2_000])

    @contextmanager
    def attached(self) -> Iterator[None]:
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeHandler(self)


class Judge:
    """Sends requests and records every response that breaks the rules, with what the server
    logged while it was handled."""

    def __init__(self, http: httpx.Client, log: ServerLog) -> None:
        self.http = http
        self.log = log
        self.failures: list[Failure] = []
        # What the fuzz reached, for its log: response statuses, and how batches ended.
        self.statuses: Counter[int | str | None] = Counter()

    def fail(
        self, where: str, payload: bytes, status: int | None, problem: str, since: int
    ) -> None:
        self.failures.append(Failure(where, payload, status, problem, self.log.lines[since:]))

    def post(
        self,
        path: str,
        payload: bytes,
        content_type: str | bytes,
        *,
        success: type[BaseModel] | None,
        chunk: type[BaseModel] | None = None,
    ) -> httpx.Response | None:
        """POSTs `payload` and judges the answer: an error, `success`, or (streamed) `chunk`
        events. Returns the response when it was a 200 that parsed."""
        since = len(self.log.lines)
        where = f"POST {path}"
        if content_type != "application/json":
            where += f" content-type {content_type[:80]!r}"
        # A connection of its own: a server that drops one after a failure must not have the
        # next request blamed for it.
        headers = {"content-type": content_type, "connection": "close"}
        try:
            with self.http.stream("POST", path, content=payload, headers=headers) as response:
                body = response.read()
        except httpx.HTTPError as exc:
            self.statuses[None] += 1
            self.fail(where, payload, None, f"no answer: {type(exc).__name__}: {exc}", since)
            return None
        self.statuses[response.status_code] += 1
        problem = self._problem(response, body, success, chunk)
        if problem is not None:
            self.fail(where, payload, response.status_code, problem, since)
            return None
        return response if response.status_code == 200 else None

    def _problem(
        self,
        response: httpx.Response,
        body: bytes,
        success: type[BaseModel] | None,
        chunk: type[BaseModel] | None,
    ) -> str | None:
        status = response.status_code
        if status != 200:
            return error_problem(status, body)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            if chunk is None:
                return "a stream where none was asked for"
            return stream_problem(body, chunk)
        if success is None:
            return "a 200 where only errors were possible"
        return model_problem(success, body)


def error_problem(status: int, body: bytes) -> str | None:
    """Why an error response breaks the rules, or None."""
    try:
        error = ErrorResponse.model_validate_json(body).error
    except ValidationError:
        return f"not an OpenAI-shaped error: {body[:300]!r}"
    if status >= 500 and error.code not in DOCUMENTED_5XX.get(status, set()):
        return f"server error: {error.type}/{error.code}: {error.message[:200]}"
    if not 400 <= status < 600:
        return f"status {status} for an error"
    return None


def model_problem(model: type[BaseModel], body: bytes) -> str | None:
    try:
        model.model_validate_json(body)
    except ValidationError as exc:
        return f"a 200 that is not a {model.__name__}: {exc.errors()[0]} in {body[:200]!r}"
    return None


def stream_problem(body: bytes, chunk: type[BaseModel]) -> str | None:
    """Why a server-sent event stream breaks the rules: each event a chunk, the last `[DONE]` or
    an error event that is the client's fault."""
    events = [e for e in body.split(b"\n\n") if e]
    if not events:
        return "an empty stream"
    for i, event in enumerate(events):
        last = i == len(events) - 1
        if event.startswith(b"event: "):  # a Responses stream's typed event
            if problem := response_event_problem(event, i):
                return f"event {i}: {problem}"
            if event.split(b"\n")[0].removeprefix(b"event: ") in RESPONSE_ENDS:
                return None if last else f"events after the end at {i}"
            continue
        if not event.startswith(b"data: "):
            return f"event {i} is not a data event: {event[:200]!r}"
        data = event.removeprefix(b"data: ")
        if data == b"[DONE]":
            return None if last else f"[DONE] at event {i} of {len(events)}"
        if b'"error"' in data[:20]:
            problem = error_problem(400, data)
            if problem is None and json.loads(data)["error"]["type"] == "server_error":
                problem = f"a server error in the stream: {data[:300]!r}"
            return problem or (None if last else f"events after an error at {i}")
        if problem := model_problem(chunk, data):
            return f"event {i}: {problem}"
    return "the stream ended without [DONE] or the response's end"


RESPONSE_ENDS = {b"response.completed", b"response.incomplete", b"response.failed"}


def response_event_problem(event: bytes, number: int) -> str | None:
    """Why a Responses event breaks the rules: an `event:` line naming its type, data of that
    type numbered `number`, no server error, and a whole Response in the ones that carry it."""
    head, _, data = event.partition(b"\n")
    kind = head.removeprefix(b"event: ").decode()
    if not data.startswith(b"data: "):
        return f"no data line: {event[:200]!r}"
    fields = json.loads(data.removeprefix(b"data: "))
    if fields.get("type") != kind or fields.get("sequence_number") != number:
        return f"type or sequence_number do not match: {data[:200]!r}"
    if kind == "error" and fields.get("code") == "server_error":
        return f"a server error in the stream: {data[:300]!r}"
    if "response" in fields:
        return model_problem(Response, json.dumps(fields["response"]).encode())
    return None


# ---------------------------------------------------------------------------------------------
# Uploads: multipart bodies written by hand, so that names and bytes can be anything.

BOUNDARY = b"fuzz-8d1f0c"


@dataclass(frozen=True)
class Part:
    disposition: bytes  # the Content-Disposition header's value
    content: bytes
    extra_headers: bytes = b""

    def encode(self) -> bytes:
        return (
            b"--"
            + BOUNDARY
            + b"\r\nContent-Disposition: "
            + self.disposition
            + b"\r\n"
            + self.extra_headers
            + b"\r\n"
            + self.content
            + b"\r\n"
        )


def multipart(parts: list[Part]) -> bytes:
    return b"".join(part.encode() for part in parts) + b"--" + BOUNDARY + b"--\r\n"


FIELD_NAMES = [
    b"file",
    b"purpose",
    b"expires_after[anchor]",
    b"expires_after[seconds]",
    b"a" * 100_000,
    b"",
    b"\x00",
    b"\xff\xfe",
    b"\xc0\xaf",
    "\U0001d54f".encode() * 1000,
    b"expires_after[",
    b"expires_after[seconds][x]",
    b"purpose\r\nX-Injected: 1",
]
FILENAMES = [
    b"in.jsonl",
    b"",
    b"a" * 10_000,
    b"\xff\xfe.jsonl",
    b"../../etc/passwd",
    b"\x00",
    b"%00",
]
FIELD_VALUES = [
    b"batch",
    b"user_data",
    b"created_at",
    b"3600",
    b"-1",
    str(2**64).encode(),
    b"1e400",
    b"NaN",
    b"",
    b"\x00",
    b"\xff\xfe",
    b"\xc0\xaf",
    b"b" * 100_000,
    b"batch\x00",
]


def _line(url: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda body: {"custom_id": "c", "method": "POST", "url": url, "body": body}


PLAIN_LINE = _line("/v1/chat/completions")(CHAT_BASE)
# A batch input line: well-formed around a hostile body, or hostile itself.
hostile_lines: SearchStrategy[Any] = st.one_of(
    hostile_bodies(CHAT_BASE, CHAT_TARGETS).map(_line("/v1/chat/completions")),
    hostile_bodies(COMPLETION_BASE, COMPLETION_TARGETS).map(_line("/v1/completions")),
    hostile_bodies(PLAIN_LINE, [Target((name,)) for name in [*PLAIN_LINE, "extra"]]),
    st.sampled_from([Raw(b) for b in WHOLE_BODIES[:8]]),
)


def jsonl(lines: list[Any]) -> bytes:
    """Lines with distinct custom_ids (so a repeat is not the only fault found)."""
    out = []
    for i, line in enumerate(lines):
        if isinstance(line, dict) and line.get("custom_id") == "c":
            line = {**line, "custom_id": f"c{i}"}
        out.append(encode(line))
    return b"\n".join(out) + b"\n"


@st.composite
def uploads(draw: st.DrawFn) -> tuple[bytes, str]:
    """(body, content type) of an upload: some hostile parts, often around a valid core."""
    parts: list[Part] = []
    if draw(st.booleans()):
        parts.append(Part(b'form-data; name="purpose"', b"batch"))
    if draw(st.booleans()):
        content = jsonl(draw(st.lists(hostile_lines, min_size=1, max_size=4)))
        parts.append(Part(b'form-data; name="file"; filename="in.jsonl"', content))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELD_NAMES))
        disposition = b'form-data; name="' + name + b'"'
        if draw(st.booleans()):
            disposition += b'; filename="' + draw(st.sampled_from(FILENAMES)) + b'"'
        extra = draw(st.sampled_from([b"", b"Content-Type: application/json\r\n", b"X: \xff\r\n"]))
        parts.append(Part(disposition, draw(st.sampled_from(FIELD_VALUES)), extra))
    if draw(st.integers(0, 9)) == 0:  # many fields
        parts += [Part(b'form-data; name="f%d"' % i, b"v") for i in range(5_000)]
    parts = draw(st.permutations(parts))
    content_type = draw(
        st.sampled_from(
            ["multipart/form-data; boundary=" + BOUNDARY.decode()] * 6
            + [
                "multipart/form-data",
                "multipart/form-data; boundary=",
                "multipart/form-data; boundary=" + "x" * 10_000,
                "multipart/form-data; boundary=\x7f",
                "application/json",
                "multipart/mixed; boundary=" + BOUNDARY.decode(),
            ]
        )
    )
    return multipart(parts), content_type


# ---------------------------------------------------------------------------------------------
# The test


@pytest.mark.parametrize("storage", ["embedded"], indirect=True)
def test_hostile_requests_get_client_errors_and_leave_the_service_working(
    serve_batches: Callable[..., BatchServer], subtests: pytest.Subtests
) -> None:
    server = serve_batches()
    log = ServerLog()
    with log.attached(), server.http() as http:
        http.timeout = httpx.Timeout(REQUEST_TIMEOUT_SECONDS)
        judge = Judge(http, log)
        areas: list[tuple[str, Callable[[Judge, BatchServer], None]]] = [
            ("fixed cases", fuzz_fixed_cases),
            ("chat completions", fuzz_chat),
            ("completions", fuzz_completions),
            ("responses", fuzz_responses),
            ("whole bodies", fuzz_whole_bodies),
            ("schema-driven bodies", fuzz_schema_driven),
            ("file uploads", fuzz_uploads),
            ("batch creation", fuzz_batch_creation),
            ("batches of hostile lines", fuzz_batch_runs),
        ]
        for name, area in areas:
            with subtests.test(msg=name):
                before = len(judge.failures)
                judge.statuses.clear()
                started = time.monotonic()
                area(judge, server)
                found = judge.failures[before:]
                print(
                    f"{name}: {time.monotonic() - started:.1f} s, statuses "
                    f"{dict(judge.statuses)}, {len(found)} failures"
                )
                assert not found, report(found)
        with subtests.test(msg="the service still works"):
            assert_still_serving(server, http)


REALTIME_MODELS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    # (the whole response, one streamed chunk)
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/completions": (Completion, Completion),
    "/v1/responses": (Response, Response),  # streamed: typed events (response_event_problem)
}


def send_realtime(judge: Judge, path: str, body: dict[str, Any]) -> None:
    success, chunk = REALTIME_MODELS[path]
    judge.post(path, encode(body), "application/json", success=success, chunk=chunk)


def fuzz_fixed_cases(judge: Judge, _server: BatchServer) -> None:
    for path, body in FIXED_CASES:
        send_realtime(judge, path, body)


def realtime_area(
    path: str, base: dict[str, Any], targets: list[Target], examples: int = REALTIME_EXAMPLES
) -> Callable[[Judge, BatchServer], None]:
    def area(judge: Judge, _server: BatchServer) -> None:
        @settings(FUZZ, max_examples=examples)
        @given(body=hostile_bodies(base, targets), stream=st.booleans())
        def check(body: dict[str, Any], stream: bool) -> None:
            send_realtime(judge, path, {"stream": stream, **body})

        check()

    return area


fuzz_chat = realtime_area("/v1/chat/completions", CHAT_BASE, CHAT_TARGETS)
fuzz_completions = realtime_area("/v1/completions", COMPLETION_BASE, COMPLETION_TARGETS)
fuzz_responses = realtime_area(
    "/v1/responses", RESPONSES_BASE, RESPONSE_TARGETS, RESPONSES_EXAMPLES
)


def fuzz_whole_bodies(judge: Judge, _server: BatchServer) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
        for payload in WHOLE_BODIES:
            judge.post(path, payload, "application/json", success=None)
        judge.post(path, b'{"model": "tiny"}', b"application/json; charset=\xff", success=None)


def fuzz_schema_driven(judge: Judge, server: BatchServer) -> None:
    """schemathesis' valid bodies for both endpoints from `/openapi.json` (messages, tools and
    response formats of every documented shape), with one hostile field each."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    for path, targets in (
        ("/v1/chat/completions", CHAT_TARGETS),
        ("/v1/completions", COMPLETION_TARGETS),
    ):
        fuzz_operation(judge, schema[path]["POST"], path, targets)


def fuzz_operation(judge: Judge, operation: APIOperation, path: str, targets: list[Target]) -> None:
    length = "max_tokens" if path == "/v1/completions" else "max_completion_tokens"

    @settings(FUZZ, max_examples=SCHEMA_EXAMPLES)
    @given(case=operation.as_strategy(), target=st.sampled_from(targets), data=st.data())
    def check(case: Case, target: Target, data: st.DataObject) -> None:
        # Generated lengths would run to thousands of tokens: a few show the same shapes.
        body = {k: v for k, v in case.body.items() if k not in GENERATION_FIELDS}
        body = {**body, **target.base, "model": MODEL, length: 2}
        send_realtime(judge, path, set_path(body, target.path, data.draw(target.values)))

    check()


def fuzz_uploads(judge: Judge, _server: BatchServer) -> None:
    @settings(FUZZ, max_examples=UPLOAD_EXAMPLES)
    @given(upload=uploads())
    def check(upload: tuple[bytes, str]) -> None:
        body, content_type = upload
        judge.post("/v1/files", body, content_type, success=FileObject)

    check()


def upload_lines(judge: Judge, content: bytes) -> str | None:
    """The id of a batch file holding `content`, or None (a failure recorded) if refused."""
    body = multipart(
        [
            Part(b'form-data; name="purpose"', b"batch"),
            Part(b'form-data; name="file"; filename="in.jsonl"', content),
        ]
    )
    content_type = "multipart/form-data; boundary=" + BOUNDARY.decode()
    response = judge.post("/v1/files", body, content_type, success=FileObject)
    return None if response is None else response.json()["id"]


EXPIRES_AFTER = {"output_expires_after": {"anchor": "created_at", "seconds": 3600}}


def fuzz_batch_creation(judge: Judge, _server: BatchServer) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": COMPLETION_BASE}
    file_id = upload_lines(judge, jsonl([line]))
    if file_id is None:
        return
    base = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    targets = [
        *(Target((name,)) for name in [*BatchCreate.model_fields, "unknown_field"]),
        Target(("metadata", "k")),
        Target(("metadata",), st.builds(lambda k: {k: "v"}, hostile_keys)),
        Target(("metadata",), st.just({f"k{i}": "v" for i in range(1_000)})),
        Target(("output_expires_after", "seconds"), base=EXPIRES_AFTER),
        Target(("output_expires_after", "anchor"), base=EXPIRES_AFTER),
    ]

    # Values the error messages echo, always sent.
    for echoed in (
        {"input_file_id": "file-\ud800"},
        {"endpoint": "/v1/\ud800"},
        {"completion_window": "\ud800"},
        {"metadata": {"\ud800": "v"}},
        {"\ud800": 1},
    ):
        judge.post(
            "/v1/batches", encode({**base, **echoed}), "application/json", success=BatchObject
        )

    @settings(FUZZ, max_examples=BATCH_CREATE_EXAMPLES)
    @given(body=hostile_bodies(base, targets))
    def check(body: dict[str, Any]) -> None:
        judge.post("/v1/batches", encode(body), "application/json", success=BatchObject)

    check()


@st.composite
def batch_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, JSONL): mostly well-formed lines with hostile bodies, which run and get their
    endpoint's errors; sometimes a hostile line too, which fails the batch's validation."""
    endpoint = draw(st.sampled_from(list(REALTIME_MODELS)))
    base, targets = (
        (CHAT_BASE, CHAT_TARGETS)
        if endpoint == "/v1/chat/completions"
        else (COMPLETION_BASE, COMPLETION_TARGETS)
    )
    bodies = draw(st.lists(hostile_bodies(base, targets), min_size=3, max_size=6))
    lines: list[Any] = [_line(endpoint)(body) for body in [base, *bodies]]  # base succeeds
    if draw(st.integers(0, 3)) == 0:
        lines.append(draw(hostile_lines))
    return endpoint, jsonl(lines)


def fuzz_batch_runs(judge: Judge, server: BatchServer) -> None:
    @settings(FUZZ, max_examples=BATCH_RUNS)
    @given(batch_file=batch_files())
    def check(batch_file: tuple[str, bytes]) -> None:
        endpoint, content = batch_file
        run_batch(judge, server, endpoint, content)

    check()


def run_batch(judge: Judge, server: BatchServer, endpoint: str, content: bytes) -> None:
    """Runs a batch of `content` to its end and judges its output and error lines."""
    since = len(judge.log.lines)
    file_id = upload_lines(judge, content)
    if file_id is None:
        return
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    created = judge.post("/v1/batches", encode(body), "application/json", success=BatchObject)
    if created is None:
        return
    batch = wait_for_batch(judge.http, created.json()["id"])
    judge.statuses[f"batch {batch.status}"] += 1

    def fail(problem: str) -> None:
        judge.fail(f"batch {batch.id} on {endpoint}", content, None, problem, since)

    if batch.status not in TERMINAL:
        return fail(f"still {batch.status} after {BATCH_TIMEOUT_SECONDS} s")
    if batch.status == "failed":
        # Validation refused the file: it must say why, line by line.
        if batch.errors is None or not batch.errors.data:
            fail("failed without errors")
        return None
    if batch.status != "completed":
        return fail(f"ended {batch.status}")
    success, _chunk = REALTIME_MODELS[endpoint]
    for file_id in (batch.output_file_id, batch.error_file_id):
        for raw in download(judge.http, file_id):
            if problem := batch_line_problem(raw, success):
                fail(f"{problem}\n  line: {raw[:500]!r}")


def wait_for_batch(http: httpx.Client, batch_id: str) -> BatchObject:
    deadline = time.monotonic() + BATCH_TIMEOUT_SECONDS
    while True:
        batch = BatchObject.model_validate_json(http.get(f"/v1/batches/{batch_id}").content)
        if batch.status in TERMINAL or time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def download(http: httpx.Client, file_id: str | None) -> list[bytes]:
    if file_id is None:
        return []
    response = http.get(f"/v1/files/{file_id}/content")
    response.raise_for_status()
    return response.content.splitlines()


def batch_line_problem(raw: bytes, success: type[BaseModel]) -> str | None:
    """Why an output or error line breaks the rules: it must parse, and hold either a 200 with
    the endpoint's object, a 4xx with an OpenAI error, or a line error."""
    try:
        line = BatchOutputLine.model_validate_json(raw)
    except ValidationError as exc:
        return f"a line that is no batch output line: {exc.errors()[0]}"
    if line.response is None:
        return None if line.error is not None else "neither response nor error"
    body = json.dumps(line.response.body).encode()
    status = line.response.status_code
    return model_problem(success, body) if status == 200 else error_problem(status, body)


# ---------------------------------------------------------------------------------------------
# After the fuzz: the same server still does its ordinary work.


def assert_still_serving(server: BatchServer, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    client = server.client(timeout=REQUEST_TIMEOUT_SECONDS)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=4
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    answer = client.responses.create(model=MODEL, input="Hello", max_output_tokens=16)
    assert answer.status in ("completed", "incomplete")
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True)
    assert [chunk for chunk in stream if chunk.choices], "the stream carried no choices"

    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": COMPLETION_BASE}
        for i in range(6)
    ]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_for_batch(http, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
