"""Structured output: what a request's output must be, as a grammar, and the schema bounder that
writes one from JSON Schema.

`StructuredOutput` is plain data a caller puts in `SamplingParams.structured`: it is built (and so
validated) before any engine work, and carries the grammar as xgrammar EBNF text. What an API's
fields ask for (OpenAI's `response_format` and tools: pagedbatch/protocol/structured_output.py) is
the caller's to turn into one. The engine enforces it token by token (grammar_runtime.py).

Whatever a model samples, a constrained output must end: a random model never closes a string
or stops padding by chance. So grammars allow no whitespace between JSON tokens, and strings,
arrays and open-ended objects without their own bound get one from `OutputLimits` (`_Bounder`).
Bounds only narrow a schema, so every output still validates against the schema as given.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

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
    `json_schema` or `structural_tag`; a hand-written grammar is checked on construction.

    `starts_after` is a token the grammar waits for: the output is free up to and including its
    first sampling of that token, and obeys the grammar from the next one, as vLLM applies
    structured output to a reasoning model's answer after its thinking (`</think>`). None: the
    grammar applies from the first token.
    """

    grammar: str
    starts_after: int | None = None

    def __post_init__(self) -> None:
        after = self.starts_after
        if after is not None and (type(after) is not int or after < 0):
            raise ValueError(f"starts_after must be a token id, got {after!r}")
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
