"""The HTTP side of OpenAI-shaped errors (pagedbatch/protocol/errors.py holds the shape)."""

from __future__ import annotations

from starlette.exceptions import HTTPException

from pagedbatch.protocol.errors import OpenAIError


class BodyTooLarge(HTTPException):
    """A request body beyond its route's limit. An HTTPException rather than an OpenAIError, as
    FastAPI's body parsing turns any other exception into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is too large: the limit is {limit} bytes.")

    def openai(self) -> OpenAIError:
        return OpenAIError(self.detail, status_code=413, code="request_too_large")
