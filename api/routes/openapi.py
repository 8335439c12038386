"""What the OpenAPI document says beyond what FastAPI infers from the route signatures.

Routes that parse their own bodies (for OpenAI-style errors, or to stream uploads) and errors that
are raised rather than returned are invisible to FastAPI; these helpers declare them, so that
clients generated from `/openapi.json`, and schemathesis, see the API as it behaves.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedbatch.protocol.errors import ErrorResponse

_ERROR_DESCRIPTIONS: dict[int | str, str] = {
    400: "The request is invalid: a parameter is missing, malformed or out of range.",
    401: "No API key was sent, or an incorrect one.",
    404: "No such object, or it belongs to another API key.",
    409: "The object is in use: the change would cut short work that depends on it.",
    # FastAPI documents a 422 for every route with parameters unless a 4XX entry exists; the app
    # never sends a 422, and anything else in the range (405, ...) has the same body.
    "4XX": "Another client error, such as a method the URL does not allow.",
}


def error_responses(*statuses: int | str) -> dict[int | str, dict[str, Any]]:
    """`responses` entries for the errors a route answers with, each an `ErrorResponse` body."""
    return {
        status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }


# OpenAPI 3.1 has a text/event-stream `schema` describe one event, as parsed into its fields.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "A chunk object as JSON; the last event's data is `[DONE]`.",
        }
    },
}


# A Responses stream's event: its type named on an `event:` line, and no [DONE].
_TYPED_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "description": "The event's type, e.g. response.created."},
        "data": {
            "type": "string",
            "description": "The event object as JSON, with its `type` and `sequence_number`; "
            "the last is response.completed, response.incomplete or response.failed.",
        },
    },
}


def streamed(model: type[BaseModel], typed: bool = False) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that answers `model` as JSON, or as server-sent events when the
    request asks to stream: chunks then [DONE], or (`typed`) the Responses API's typed events."""
    event = _TYPED_EVENT if typed else _SSE_EVENT
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring `model` as the JSON body of a route that validates it itself."""
    return _body(model, "application/json")


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """The same for a multipart form (a `bytes` field is a file part)."""
    return _body(model, "multipart/form-data")


def _body(model: type[BaseModel], media_type: str) -> dict[str, Any]:
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {
            "required": True,
            "content": {media_type: {"schema": _inline(schema, definitions)}},
        }
    }


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    # pydantic's `#/$defs/...` references would resolve against the whole OpenAPI document, where
    # they do not exist; request models are small and not recursive, so they are copied in place.
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            siblings = {key: value for key, value in node.items() if key != "$ref"}
            target = definitions[ref.removeprefix("#/$defs/")]
            return _inline({**target, **siblings}, definitions)
        return {key: _inline(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    return node
