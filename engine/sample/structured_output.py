"""Structured output: JSON mode, JSON Schema, structural tags and grammars, enforced token by
token by xgrammar.

Two halves. `StructuredOutput` is plain data a caller puts in `SamplingParams.structured`: it is
built (and so validated) before any engine work, and carries the grammar as xgrammar EBNF text.
What an API's fields ask for (OpenAI's `response_format` and tools: pagedbatch/protocol/
structured_output.py) is the caller's to turn into one. `GrammarRuntime` is the engine's:
it compiles grammars against the tokenizer off the engine thread (each cache salt, that is each
tenant, on a lane of its own, within a time budget; cached per salt, least recently used
dropped), keeps one matcher per constrained request, masks the logits of each step in one batched
call, and says when a grammar has ended so the engine stops the request without waiting for EOS.

Whatever a model samples, a constrained output must end: a random model never closes a string
or stops padding by chance. So grammars allow no whitespace between JSON tokens, and strings,
arrays and open-ended objects without their own bound get one from `OutputLimits`. Bounds only
narrow a schema, so every output still validates against the schema as given.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ValidationError

from pagedbatch.engine.config import EngineArgs

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from pagedbatch.engine.core.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputLimits:
    """Bounds for what a schema leaves unbounded (JSON mode leaves everything unbounded).

    A bounded string holds no escapes (no quote, backslash or newline): xgrammar's length-bounded
    strings have none, and a version with them makes token masks thousands of times slower.
    `max_string_length=None` leaves strings unbounded, escapes allowed: for a model trusted to
    close its strings. A bounded number has at most 6 decimals and no exponent (xgrammar's ranges).
    """

    max_string_length: int | None = 256  # characters
    max_number: int | None = 10**15  # magnitude, for numbers without a minimum or maximum
    max_items: int = 32  # array items, and properties of an object with undeclared ones
    max_depth: int = 4  # nesting of values the schema leaves free ({} or true)

    def __post_init__(self) -> None:
        for name in ("max_string_length", "max_number", "max_items", "max_depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


# Compiling a grammar takes time superlinear in its size (2,000 optional properties: minutes):
# past this bound a schema is refused without compiling. Within it, what a compile costs depends
# on more than size (3,000 enum strings of 300 characters: 0.9 MB of grammar, 20 s and 240 MB
# compiled), so compiles are also held to a time budget (GrammarRuntime).
MAX_GRAMMAR_CHARS = 2**20


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: a grammar (xgrammar EBNF). Build one with `json_object`,
    `json_schema` or `structural_tag`; a hand-written grammar is checked on construction."""

    grammar: str

    def __post_init__(self) -> None:
        _check_ebnf(self.grammar)

    @classmethod
    def json_object(cls, limits: OutputLimits = OutputLimits()) -> StructuredOutput:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls(_json_grammar("{}", False, limits, json_object=True))

    @classmethod
    def json_schema(
        cls,
        schema: Mapping[str, Any] | bool,
        strict: bool = False,
        limits: OutputLimits = OutputLimits(),
    ) -> StructuredOutput:
        """A JSON value valid for `schema`. Raises ValueError naming what is wrong with it.

        Objects that declare properties get only those, as OpenAI's strict mode requires. With
        `strict`, a validation keyword the grammar cannot enforce is an error; without it, the
        keyword is dropped (best effort, as OpenAI treats non-strict schemas).
        """
        return cls(_json_grammar(_canonical(schema), strict, limits))

    @classmethod
    def structural_tag(cls, form: dict[str, Any]) -> StructuredOutput:
        """Output of the shape `form`, an xgrammar structural-tag format in its JSON form: text
        between a begin and an end around a content, sequences, alternatives and repeats of
        formats, free text until a trigger opens a tag. A `{"type": "grammar"}` content is EBNF,
        such as another StructuredOutput's grammar. Raises ValueError naming what is wrong."""
        import xgrammar as xgr  # here, not at start: the engine starts without it

        try:
            grammar = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": form})
        except RuntimeError as e:
            message = _XGRAMMAR_LOG_PREFIX.sub("", str(e).strip())
            raise ValueError(f"invalid structural tag: {message}") from None
        return cls(str(grammar))


# JSON Schema to grammar ----------------------------------------------------------------------

_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
# Keywords the grammar enforces; a schema with none of them accepts any value.
_ENFORCED = frozenset(
    {
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
        "properties", "patternProperties", "additionalProperties", "propertyNames", "required",
        "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Validation keywords xgrammar does not enforce (or gets wrong: `contains` yields only []).
_UNENFORCEABLE = frozenset(
    {
        "not", "if", "then", "else", "contains", "minContains", "maxContains",
        "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
        "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_NUMBERS = (*_RANGE, "multipleOf")
_ORDERED = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems")
_OBJECT_KEYWORDS = (
    "properties", "patternProperties", "additionalProperties", "propertyNames", "required",
    "minProperties", "maxProperties",
)  # fmt: skip

# xgrammar 0.2.9 spells the characters of a length-bounded string `[^"\\\r\n]`, which lets raw
# control characters through (strict JSON parsers reject them).
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_PLAIN_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'
_FREE_VALUE = "pagedbatch_free_value_"  # the $defs names of free values, by depth
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _canonical(schema: Mapping[str, Any] | bool) -> str:
    """The schema as JSON text: the cache key, and a check that it is JSON at all."""
    try:
        return json.dumps(schema, allow_nan=False)  # key order is the order of the output
    except (TypeError, ValueError) as e:
        raise ValueError(f"the JSON schema is not JSON: {e}") from None


@lru_cache(maxsize=512)
def _json_grammar(
    schema_text: str, strict: bool, limits: OutputLimits, json_object: bool = False
) -> str:
    import xgrammar as xgr

    schema = _Bounder(json.loads(schema_text), strict, limits).bounded(json_object)
    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True
        )
    except RuntimeError as e:
        message = _XGRAMMAR_LOG_PREFIX.sub("", str(e).strip())
        raise ValueError(f"invalid JSON schema: {message}") from None
    return str(grammar).replace(_BOUNDED_STRING_CHAR, _PLAIN_STRING_CHAR)


@lru_cache(maxsize=512)
def _check_ebnf(grammar: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"the schema or tools are too large to enforce: their grammar has {len(grammar)} "
            f"characters, over the limit of {MAX_GRAMMAR_CHARS} (about 500 properties)"
        )
    import xgrammar as xgr

    try:
        xgr.Grammar.from_ebnf(grammar)
    except (RuntimeError, ValidationError) as e:
        message = _XGRAMMAR_LOG_PREFIX.sub("", str(e).strip())
        raise ValueError(f"invalid grammar: {message}") from None


class _Bounder:
    """Checks a JSON schema and returns a copy with every unbounded part bounded.

    Errors name the schema location as a JSON pointer ("#/properties/tags/items").
    """

    def __init__(self, document: Any, strict: bool, limits: OutputLimits):
        self.document = document
        self.strict = strict
        self.limits = limits
        self._free_depths: set[int] = set()  # the free values referred to, by depth

    def bounded(self, json_object: bool = False) -> Any:
        """The bounded schema: any JSON object with `json_object`, else the document."""
        if self.document is False:
            raise ValueError("the JSON schema is false: no output can match it")
        if json_object:
            root = self.any_object(self.limits.max_depth)
        else:
            root = self.schema(self.document, "#")
        if not self._free_depths:
            return root
        # Free values are defined once each and referred to, which keeps the grammar linear in
        # the depth (written out, each level would hold two copies of the next).
        definitions = root.setdefault("$defs", {})
        for depth in sorted(self._free_depths):
            definitions[f"{_FREE_VALUE}{depth}"] = self._free_value(depth)
        return root

    def schema(self, node: Any, path: str) -> Any:
        if node is True:
            return self.any_value(self.limits.max_depth)
        if node is False:
            return False
        if not isinstance(node, dict):
            raise ValueError(f"invalid JSON schema at {path}: a schema is an object or a boolean")
        self._check(node, path)
        node = self._drop_unenforceable(dict(node), path)
        if not _ENFORCED & node.keys():
            return self.any_value(self.limits.max_depth)
        for key in ("properties", "patternProperties", "$defs", "definitions"):
            if key in node:
                node[key] = {k: self.schema(v, f"{path}/{key}/{k}") for k, v in node[key].items()}
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if key in node:
                node[key] = [self.schema(s, f"{path}/{key}/{i}") for i, s in enumerate(node[key])]
        for key in ("items", "additionalProperties", "propertyNames"):
            if key in node:
                node[key] = self.schema(node[key], f"{path}/{key}")
        types = set() if {"enum", "const"} & node.keys() else _types(node)
        if "string" in types:
            self._bound_string(node)
        if types & {"number", "integer"}:
            self._bound_number(node)
        if "array" in types:
            self._bound_array(node)
        if "object" in types:
            self._bound_object(node, path)
        return node

    def _drop_unenforceable(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        found = sorted(_UNENFORCEABLE & node.keys())
        if node.get("uniqueItems") is True:
            found.append("uniqueItems")
        if node.get("unevaluatedProperties", False) is not False:
            found.append("unevaluatedProperties")
        if len(node.get("allOf", ())) > 1:
            found.append("allOf")
        # xgrammar enforces multipleOf only on integers without a range (ours included).
        ranged = self.limits.max_number is not None or node.keys() & set(_RANGE)
        if "multipleOf" in node and (_types(node) != {"integer"} or ranged):
            found.append("multipleOf")
        if self.strict and "oneOf" in node:
            found.append("oneOf")  # enforced as anyOf, which is wrong where branches overlap
        if not found:
            return node
        if self.strict:
            raise ValueError(
                f"unsupported JSON schema keyword {found[0]!r} at {path}: strict structured output "
                "cannot enforce it"
            )
        logger.info("structured output ignores %s at %s (not strict)", found, path)
        return {k: v for k, v in node.items() if k not in found}

    def _check(self, node: dict[str, Any], path: str) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"invalid JSON schema at {path}: {why}")

        types = node.get("type", [])
        for t in types if isinstance(types, list) else [types]:
            if t not in _TYPES:
                raise bad(f"unknown type {t!r}")
        for key in _COUNTS:
            value = node.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"{key} must be a non-negative integer")
        for key in _NUMBERS:
            value = node.get(key, 0)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad(f"{key} must be a number")
        if node.get("multipleOf", 1) <= 0:
            raise bad("multipleOf must be positive")
        for low, high in _ORDERED:
            if low in node and high in node and node[low] > node[high]:
                raise bad(f"{low} {node[low]} exceeds {high} {node[high]}")
        for key in ("properties", "patternProperties", "$defs", "definitions"):
            if not isinstance(node.get(key, {}), dict):
                raise bad(f"{key} must be an object")
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if key in node and (not isinstance(node[key], list) or not node[key]):
                raise bad(f"{key} must be a non-empty array")
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise bad("enum must be a non-empty array")
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise bad("required must be an array of strings")
        if "$ref" in node:
            self._resolve(node["$ref"], path)

    def _resolve(self, ref: Any, path: str) -> None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"invalid JSON schema at {path}: only local $refs (#/...) work")
        target = self.document
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"invalid JSON schema at {path}: $ref {ref!r} points nowhere")
            target = target[part]

    def _bound_string(self, node: dict[str, Any]) -> None:
        # A pattern or format carries its own bound (or none the grammar could add to).
        limit = self.limits.max_string_length
        if limit is not None and not {"maxLength", "pattern", "format"} & node.keys():
            node["maxLength"] = max(limit, node.get("minLength", 0))

    def _bound_number(self, node: dict[str, Any]) -> None:
        limit = self.limits.max_number
        if limit is None:
            return
        low = node.get("minimum", node.get("exclusiveMinimum"))
        high = node.get("maximum", node.get("exclusiveMaximum"))
        if low is None:
            node["minimum"] = -limit if high is None else min(-limit, high - limit)
        if high is None:
            node["maximum"] = limit if low is None else max(limit, low + limit)

    def _bound_array(self, node: dict[str, Any]) -> None:
        if "maxItems" not in node:
            node["maxItems"] = max(self.limits.max_items, node.get("minItems", 0))

    def _bound_object(self, node: dict[str, Any], path: str) -> None:
        if "additionalProperties" not in node:
            # Declared properties are all an object gets; declaring none means any object.
            declared = "properties" in node or "patternProperties" in node
            free = self.any_value(self.limits.max_depth - 1)
            node["additionalProperties"] = False if declared else free
        open_ended = node["additionalProperties"] is not False
        if open_ended or "patternProperties" in node:
            least = node.get("minProperties", 0)
            node.setdefault("maxProperties", max(self.limits.max_items, least))
        if open_ended:
            node.setdefault("propertyNames", self._string())
            # The grammar writes a required property only if it is declared.
            declared = node.setdefault("properties", {})
            for name in node.get("required", []):
                declared.setdefault(name, node["additionalProperties"])
        elif "patternProperties" not in node:
            declared = node.get("properties", {})
            if undeclared := [r for r in node.get("required", []) if r not in declared]:
                raise ValueError(
                    f"invalid JSON schema at {path}: required property {undeclared[0]!r} is not "
                    "in properties and no other properties are allowed"
                )

    def _string(self) -> dict[str, Any]:
        limit = self.limits.max_string_length
        return {"type": "string"} if limit is None else {"type": "string", "maxLength": limit}

    def any_value(self, depth: int) -> dict[str, Any]:
        """Any JSON value with at most `depth` levels of arrays and objects."""
        for level in range(depth + 1):
            self._free_depths.add(level)
        return {"$ref": f"#/$defs/{_FREE_VALUE}{depth}"}

    def _free_value(self, depth: int) -> dict[str, Any]:
        number = {"type": "number"}
        self._bound_number(number)
        values: list[dict[str, Any]] = [
            self._string(),
            number,
            {"type": "boolean"},
            {"type": "null"},
        ]
        if depth > 0:
            inner = {"$ref": f"#/$defs/{_FREE_VALUE}{depth - 1}"}
            values.append({"type": "array", "items": inner, "maxItems": self.limits.max_items})
            values.append(self.any_object(depth))
        return {"anyOf": values}

    def any_object(self, depth: int) -> dict[str, Any]:
        """Any JSON object with at most `depth` levels of arrays and objects, itself included."""
        return {
            "type": "object",
            "additionalProperties": self.any_value(depth - 1),
            "propertyNames": self._string(),
            "maxProperties": self.limits.max_items,
        }


def _types(node: Mapping[str, Any]) -> set[str]:
    """The JSON types a schema node may take, as its keywords tell (none for enum, $ref...)."""
    declared = node.get("type")
    if declared is not None:
        return set(declared) if isinstance(declared, list) else {declared}
    inferred = set()
    if any(k in node for k in _STRING_KEYWORDS):
        inferred.add("string")
    if any(k in node for k in _ARRAY_KEYWORDS):
        inferred.add("array")
    if any(k in node for k in _OBJECT_KEYWORDS):
        inferred.add("object")
    return inferred


# The engine's side ---------------------------------------------------------------------------

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# And at most this much memory of them (xgrammar's own measure): a compiled grammar holds token
# masks for its states, from 0.2 MB for JSON mode to hundreds of MB.
GRAMMAR_CACHE_BYTES = 256 * 2**20


class GrammarViolation(RuntimeError):
    """A sampled token the request's grammar does not allow (a logits processor unmasked it)."""


class GrammarTooCostly(ValueError):
    """A grammar whose compile ran past its time budget: the output format asked for costs more
    to enforce than the engine gives one request. Its message begins with TOO_COSTLY."""


TOO_COSTLY = "the requested output format took more than"


def too_costly(error: str | None) -> bool:
    """Whether a request's error (RequestOutput.error) is a GrammarTooCostly: the client's
    schema or tools, not the engine, are at fault."""
    return error is not None and TOO_COSTLY in error


@dataclass
class _Job:
    grammar: str
    future: Future


class GrammarRuntime:
    """One engine's grammars and matchers, for constrained requests.

    Only the engine thread calls it. Compilation alone runs off it (xgrammar releases the GIL
    while it compiles): `compile` hands back a future, and the engine admits a request once its
    grammar is ready, stepping the others meanwhile.

    Compiles are laned by cache salt (the tenant, unless tenants share the prefix cache): each
    salt's run one at a time on a thread of its own, so one tenant's compiles never wait behind
    another's. A compile still running `compile_seconds` after it started fails its future with
    GrammarTooCostly, and stays failed in the cache (the same grammar is refused at once
    thereafter); xgrammar cannot be interrupted, so the lane's thread finishes it and drops the
    result, and that salt's later compiles wait for it (one compile at a time a salt is also what
    bounds the CPU one tenant's compiles take). Compiled grammars are cached per salt too, so a
    tenant cannot learn from a fast answer that another sent the same schema.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        compile_seconds: float = EngineArgs.grammar_compile_seconds,
        cache_size: int = GRAMMAR_CACHE_SIZE,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ):
        self.vocab_size = vocab_size
        self.compile_seconds = compile_seconds
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        # By (cache salt, grammar); the bytes of those compiled, as they are found done.
        self._compiled: OrderedDict[tuple[str | None, str], Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._sizes: dict[tuple[str | None, str], int] = {}
        self.compiles = 0  # compiles started
        self.cache_hits = 0  # compiles saved by the cache
        self._lanes: dict[str | None, deque[_Job]] = {}  # a salt's waiting compiles
        self._lanes_lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None  # built by the first compile
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        # One row of xgrammar's token bitmask (32 tokens a word), made as it makes them.
        words = -(-vocab_size // 32)
        self._scratch = torch.full((1, words), -1, dtype=torch.int32)
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[:vocab_size] = True
        allowed[self._stop_token_ids] = False
        self._non_stop = np.packbits(allowed, bitorder="little").view(np.uint32)

    def compile(
        self, spec: StructuredOutput, salt: str | None = None
    ) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, for requests of cache salt `salt`: from the cache,
        or compiled on the salt's lane."""
        key = (salt, spec.grammar)
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            self.cache_hits += 1
            return future
        future = Future()
        self._compiled[key] = future
        self._evict()
        self.compiles += 1
        job = _Job(spec.grammar, future)
        with self._lanes_lock:
            lane = self._lanes.get(salt)
            if lane is not None:  # its thread takes it next
                lane.append(job)
                return future
            self._lanes[salt] = deque([job])
        threading.Thread(
            target=self._run_lane, args=(salt,), name="pagedbatch-grammar", daemon=True
        ).start()
        return future

    def _evict(self) -> None:
        """Drop the least recently used grammars while there are too many, or while those
        compiled take more than the cache's bytes (the newest stays, whatever its size)."""
        for key, future in self._compiled.items():
            if key not in self._sizes and future.done() and future.exception() is None:
                self._sizes[key] = future.result().memory_size_bytes
        while len(self._compiled) > 1 and (
            len(self._compiled) > self._cache_size or sum(self._sizes.values()) > self._cache_bytes
        ):
            key, _ = self._compiled.popitem(last=False)
            self._sizes.pop(key, None)

    def _run_lane(self, salt: str | None) -> None:
        """A salt's compiles, one after another, until none waits (then the thread ends)."""
        while True:
            with self._lanes_lock:
                lane = self._lanes[salt]
                if not lane:
                    del self._lanes[salt]
                    return
                job = lane.popleft()
            self._run(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            self._compiler_ready()  # once an engine, and not a request's time
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            _settle(job.future, exception=e)
            return
        budget = threading.Timer(self.compile_seconds, self._expire, (job.future,))
        budget.daemon = True
        budget.start()
        try:
            compiled = self._compile(job.grammar)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            _settle(job.future, exception=e)
        else:
            _settle(job.future, result=compiled)  # dropped if the budget ran out first
        finally:
            budget.cancel()

    def _expire(self, future: Future) -> None:
        _settle(
            future,
            exception=GrammarTooCostly(
                f"{TOO_COSTLY} {self.compile_seconds:g} s to compile, the most one request may "
                "take (grammar_compile_seconds): use a smaller schema or fewer tools (fewer or "
                "shorter enum values, fewer properties)"
            ),
        )

    def _compiler_ready(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = _tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                threads = max(1, min(8, (os.cpu_count() or 2) // 2))
                # Thread-safe: lanes compile on it at once.
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def _compile(self, grammar: str) -> xgr.CompiledGrammar:
        return self._compiler_ready().compile_grammar(grammar)

    def start(self, request_id: str, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply_masks(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set to -inf, in place, every logit a row's grammar forbids next (one batched call)."""
        rows = [i for i, request in enumerate(requests) if request.request_id in self._matchers]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        for i in rows:
            self._matchers[requests[i].request_id].fill_next_token_bitmask(bitmask, i)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's grammar past its sampled token. True once the grammar has ended:
        a stop token was accepted, or nothing but one may follow (so the engine need not spend a
        step sampling it). Unconstrained requests never end here."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            raise GrammarViolation(f"token {token} does not follow the request's grammar")
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        # Complete, yet it may go on (more digits, more text): ended only if it cannot.
        matcher.fill_next_token_bitmask(self._scratch)
        return not (self._scratch.numpy().view(np.uint32) & self._non_stop).any()


def _settle(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Finish `future` unless it has finished already (a compile and its budget race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    # xgrammar reads an added special token such as <|im_start|> as its text, and would let it
    # into a JSON string; spelled as nothing, a token counts as special and is never allowed.
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    for i in special:
        if i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
