"""Lines of batch files: an input line, an output (or error-file) line, and the input line checks.

The check codes are the ones a batch validation reports in `errors.data` (`code`, `line`,
`param`, `message`); a body the endpoint would refuse is not a line error but a response with the
endpoint's status and error body.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, StrictStr, ValidationError

from pagedbatch.ids import new_id
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.common import TOO_DEEP
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.schemas.embeddings import EmbeddingRequest
from pagedbatch.protocol.schemas.responses import ResponseCreateRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.common import (
    Prepared,
    ServedModel,
    not_supported,
    parse_request,
)
from pagedbatch.protocol.serving.completions import prepare_completion
from pagedbatch.protocol.serving.embeddings import prepare_embedding
from pagedbatch.protocol.serving.responses import prepare_response

logger = logging.getLogger(__name__)


class BatchInputLine(BaseModel):
    custom_id: StrictStr
    method: StrictStr
    url: StrictStr
    body: dict[str, Any]


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


class BatchOutputLine(BaseModel):
    id: str
    custom_id: str | None  # null only when the input line had none
    response: BatchResponse | None = None
    error: BatchError | None = None


class InvalidBatchLine(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        *,
        line: int,
        param: str | None = None,
        custom_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.custom_id = custom_id
        self.error = BatchError(code=code, message=message, param=param, line=line)


@dataclass(frozen=True)
class LongLine:
    """An input line longer than a line may be: its first `len(head)` bytes (as many as a line
    may have), and how many it has. Nothing past the head is kept, parsed or tokenized."""

    head: bytes
    size: int


# A JSON string, or a quote that opens one the text cuts short, or a structural character.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|["{}\[\]:,]')


def top_level_string(text: bytes, key: str) -> str | None:
    """The string value of `key` in the JSON object that `text` begins, found without parsing
    the object (its values are skipped, not built); None if `text` does not hold it."""
    depth, want, current = 0, "object", None
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token == b'"':  # a string that `text` cuts short
            return None
        if depth > 1:
            depth += (token in (b"{", b"[")) - (token in (b"}", b"]"))
            continue
        if want == "object":
            if token != b"{":
                return None
            depth, want = 1, "key"
        elif token in (b"{", b"["):  # a value that is an object or array
            depth, want = 2, "comma"
        elif token == b"}":
            return None
        elif token == b":" and want == "colon":
            want = "value"
        elif token == b",":
            want = "key"
        elif token.startswith(b'"') and want in ("key", "value"):
            try:
                text_value = json.loads(token)
            except ValueError:  # a bad escape
                return None
            if want == "value" and current == key:
                return text_value
            current, want = text_value, "colon" if want == "key" else "comma"
        else:
            return None
    return None


class InputLineChecker:
    """Checks input lines one at a time, remembering custom_ids to catch repeats."""

    def __init__(self, urls: Collection[str]) -> None:
        self.urls = urls
        self._seen: set[str] = set()

    def check_long(self, long: LongLine, line: int, limit: int) -> tuple[str, OpenAIError]:
        """The custom_id of a line past `limit` bytes, and the error the endpoint answers a body
        past its limit with, which is the line's result; `InvalidBatchLine` if no custom_id can
        be read from the line's head (the line then cannot fail alone)."""
        custom_id = top_level_string(long.head, "custom_id")
        if custom_id is None:
            raise InvalidBatchLine(
                "line_too_large",
                f"The line has {long.size} bytes, more than the {limit} a line may have, and no "
                f"custom_id was found in its first {len(long.head)} bytes.",
                line=line,
            )
        self._claim(custom_id, line)
        error = OpenAIError(
            f"The request is too large: its line has {long.size} bytes, and a batch line may have "
            f"at most {limit}, as a request body may.",
            status_code=413,
            code="request_too_large",
        )
        return custom_id, error

    def check(self, raw: str | bytes, line: int) -> BatchInputLine:
        """The parsed line, or `InvalidBatchLine` saying what is wrong with it."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidBatchLine("invalid_json_line", f"Invalid JSON: {exc}", line=line) from None
        except RecursionError:
            raise InvalidBatchLine(
                "invalid_json_line", f"Invalid JSON: {TOO_DEEP}.", line=line
            ) from None
        if not isinstance(data, dict):
            raise InvalidBatchLine("invalid_json_line", "A line must be a JSON object.", line=line)
        custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) else None

        def invalid(code: str, message: str, param: str) -> InvalidBatchLine:
            return InvalidBatchLine(code, message, line=line, param=param, custom_id=custom_id)

        try:
            parsed = BatchInputLine.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(step) for step in error["loc"])
            if error["type"] == "missing":
                raise invalid(
                    "missing_required_parameter", f"Missing required parameter: '{param}'.", param
                ) from None
            raise invalid(
                "invalid_type", f"Invalid type for '{param}': {error['msg']}.", param
            ) from None
        if parsed.method != "POST":
            raise invalid(
                "invalid_method", f"method must be POST, got {parsed.method!r}.", "method"
            )
        if parsed.url not in self.urls:
            allowed = ", ".join(sorted(self.urls))
            raise invalid(
                "invalid_url", f"url must be one of {allowed}, got {parsed.url!r}.", "url"
            )
        if parsed.body.get("stream") is True:
            raise invalid(
                "stream_not_supported", "Streaming is not supported in a batch.", "body.stream"
            )
        self._claim(parsed.custom_id, line)
        return parsed

    def _claim(self, custom_id: str, line: int) -> None:
        if custom_id in self._seen:
            raise InvalidBatchLine(
                "duplicate_custom_id",
                f"custom_id {custom_id!r} is used by an earlier line.",
                line=line,
                param="custom_id",
                custom_id=custom_id,
            )
        self._seen.add(custom_id)


# Error messages quote what the client sent (a bad value, an unknown parameter's name): a
# megabyte-long value must not be copied whole into the error file, the job store and the logs.
MAX_ERROR_TEXT = 512


def _prepare_chat(body: Any, served: ServedModel) -> Prepared:
    return prepare_chat(parse_request(ChatCompletionRequest, body), served)


def _prepare_completion(body: Any, served: ServedModel) -> Prepared:
    return prepare_completion(parse_request(CompletionRequest, body), served)


def _prepare_response(body: Any, served: ServedModel) -> Prepared:
    # A line is answered once and written to the output file: nothing to run in the
    # background, and no stored response for previous_response_id to find (prepare_response
    # refuses one it is given no history for).
    request = parse_request(ResponseCreateRequest, body)
    if request.background:
        raise not_supported("background in a batch line", "background")
    return prepare_response(request, served)


def _prepare_embedding(body: Any, served: ServedModel) -> Prepared:
    return prepare_embedding(parse_request(EmbeddingRequest, body), served)


MODERATIONS = "/v1/moderations"  # run on the moderation model, where one is configured
EMBEDDINGS = "/v1/embeddings"  # run on the embedding model where one is configured, else the main
# The endpoints a line may name, and how each prepares its body; each runs on the main model but
# where workers/batches/endpoints.py picks another engine.
ENDPOINTS: dict[str, Callable[[Any, ServedModel], Prepared]] = {
    "/v1/chat/completions": _prepare_chat,
    "/v1/completions": _prepare_completion,
    "/v1/responses": _prepare_response,
    EMBEDDINGS: _prepare_embedding,
}


def bounded(text: str | None) -> str | None:
    """`text` cut to MAX_ERROR_TEXT characters, saying how much was left out."""
    if text is None or len(text) <= MAX_ERROR_TEXT:
        return text
    return f"{text[:MAX_ERROR_TEXT]}... ({len(text) - MAX_ERROR_TEXT} more characters)"


def bounded_batch_error(error: BatchError) -> BatchError:
    """`error` with its echoed text (message and param) bounded, for error lines and
    `Batch.errors` alike."""
    return error.model_copy(
        update={"message": bounded(error.message), "param": bounded(error.param)}
    )


def error_line(exc: InvalidBatchLine) -> BatchOutputLine:
    return BatchOutputLine(
        id=new_id("batch_req_"), custom_id=exc.custom_id, error=bounded_batch_error(exc.error)
    )


def response_line(custom_id: str, status_code: int, body: dict[str, Any]) -> BatchOutputLine:
    return BatchOutputLine(
        id=new_id("batch_req_"),
        custom_id=custom_id,
        response=BatchResponse(status_code=status_code, request_id=new_id("req_"), body=body),
    )


def openai_error_line(custom_id: str, exc: OpenAIError) -> BatchOutputLine:
    body = exc.body()
    detail = body["error"]
    detail["message"], detail["param"] = bounded(detail["message"]), bounded(detail["param"])
    return response_line(custom_id, exc.status_code, body)


def failed_line(custom_id: str, exc: Exception) -> BatchOutputLine:
    """The error line of a line whose handling raised `exc`: the endpoint's answer for an
    OpenAIError, a logged 500 for anything else. Call it where `exc` is being handled."""
    return openai_error_line(
        custom_id, exc if isinstance(exc, OpenAIError) else line_crashed(custom_id)
    )


def line_crashed(custom_id: str | None) -> OpenAIError:
    """The error response of a line whose handling raised something unexpected (a bug, or input
    nothing checks for yet), logged here with its traceback: the line fails, not its batch."""
    logger.exception("batch line %r failed unexpectedly", bounded(custom_id))
    return OpenAIError(
        "The server had an error while processing this request.",
        status_code=500,
        type="server_error",
    )
