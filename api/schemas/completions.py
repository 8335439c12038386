"""`POST /v1/completions` (legacy): the request body and the response object."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from pagedbatch.api.schemas.common import SamplingRequest, Usage

MAX_LOGPROBS = 5

TokenId = Annotated[int, Field(ge=0)]
NonEmpty = Field(min_length=1)

# One prompt (text or token ids) or a batch of them; each gets `n` choices.
Prompt = (
    str
    | Annotated[list[str], NonEmpty]
    | Annotated[list[TokenId], NonEmpty]
    | Annotated[list[Annotated[list[TokenId], NonEmpty]], NonEmpty]
)


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "content_filter"] | None  # null until a stream ends
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
