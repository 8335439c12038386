"""OpenAI-shaped errors, for both doors and batch lines: `{"error": {"message", "type",
"param", "code"}}` with an HTTP status.

The `openai` SDK picks its exception class from the status and reads `message`, `type`, `param` and
`code` from the body, so every failure a client can see goes through `OpenAIError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class OpenAIError(Exception):
    """A failure to report to the client, with the HTTP status to report it under."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        if code is None and status_code < 500:
            # Every client error has a code a program can branch on (docs/api.md, "Errors").
            code = "invalid_value" if param is not None else "invalid_request"
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.detail).model_dump()


def insufficient_quota(reason: str) -> OpenAIError:
    """The 429 of a request that a spend limit refuses, with `reason` saying which."""
    return OpenAIError(
        f"{reason} You exceeded your current quota; such requests are refused until the month "
        "ends or the limit is raised.",
        status_code=429,
        type="insufficient_quota",
        code="insufficient_quota",
    )


def from_validation_error(exc: ValidationError, data: Any) -> OpenAIError:
    """The 400 a client gets for a request body that `exc` rejected; `data` is that body.

    Only the first, most specific problem is reported, as OpenAI does.
    """
    # For `str | list[part]` pydantic reports a failure per branch. The deepest one, or else one
    # that is not a plain type mismatch, comes from the branch the client meant.
    error = max(exc.errors(), key=lambda e: (len(e["loc"]), not _is_type_error(e["type"])))
    kind = error["type"]
    param = _param_path(error["loc"], data, keep_last=kind == "missing")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        param = _join(param, error["ctx"]["discriminator"].strip("'"))
    if kind == "missing":
        return OpenAIError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if kind == "extra_forbidden":
        return OpenAIError(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    message = str(error["ctx"]["error"]) if kind == "value_error" else error["msg"]
    if param is None:
        return OpenAIError(message, code="invalid_value")
    if _is_type_error(kind):
        return OpenAIError(
            f"Invalid type for '{param}': {message}.", param=param, code="invalid_type"
        )
    return OpenAIError(
        f"Invalid value for '{param}': {message}.", param=param, code="invalid_value"
    )


def _is_type_error(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing"))


def _param_path(loc: Sequence[int | str], data: Any, *, keep_last: bool) -> str | None:
    """`loc` as a path into the client's JSON, e.g. `messages[0].content`.

    pydantic puts union member labels (`'user'`, `'str'`, `'list[...]'`) in `loc`; only the steps
    that address the client's data are kept. A missing field is absent from the data, so the
    last step is kept as it is when `keep_last`.
    """
    param: str | None = None
    for i, step in enumerate(loc):
        in_data = (isinstance(data, Mapping) and step in data) or (
            isinstance(data, list) and isinstance(step, int) and 0 <= step < len(data)
        )
        if in_data:
            data = data[step]
        elif not (keep_last and i == len(loc) - 1):
            continue
        param = _join(param, step)
    return param


def _join(path: str | None, step: int | str) -> str:
    if isinstance(step, int):
        return f"{path or ''}[{step}]"
    return step if path is None else f"{path}.{step}"
