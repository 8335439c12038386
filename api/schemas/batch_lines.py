"""Lines of batch files: an input line, an output (or error-file) line, and the input line checks.

The check codes are the ones a batch validation reports in `errors.data` (`code`, `line`,
`param`, `message`); a body the endpoint would refuse is not a line error but a response with the
endpoint's status and error body.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from pydantic import BaseModel, StrictStr, ValidationError


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


class InputLineChecker:
    """Checks input lines one at a time, remembering custom_ids to catch repeats."""

    def __init__(self, urls: Collection[str]) -> None:
        self.urls = urls
        self._seen: set[str] = set()

    def check(self, raw: str | bytes, line: int) -> BatchInputLine:
        """The parsed line, or `InvalidBatchLine` saying what is wrong with it."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidBatchLine("invalid_json_line", f"Invalid JSON: {exc}", line=line) from None
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
        if parsed.custom_id in self._seen:
            raise invalid(
                "duplicate_custom_id",
                f"custom_id {parsed.custom_id!r} is used by an earlier line.",
                "custom_id",
            )
        self._seen.add(parsed.custom_id)
        return parsed
