"""`POST /v1/completions` (legacy): the request body and the response object."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from pagedbatch.protocol.schemas.common import (
    INT32_MAX,
    PromptLogprobs,
    SamplingRequest,
    Text,
    TokenId,
    Usage,
    prompt_logprobs_field,
)

MAX_LOGPROBS = 5
# Prompts in one request, each run `n` times; realtime admission bounds prompts × n further.
MAX_PROMPTS = 64
# Token ids in one prompt: more than any model's context holds.
MAX_PROMPT_TOKENS = 2**20

TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]

# One prompt (text or token ids) or a batch of them; each gets `n` choices.
Prompt = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: Text | None = None

    @field_validator("use_beam_search")
    @classmethod
    def _beams_not_streamed(cls, value: bool, info: ValidationInfo) -> bool:
        # vLLM's completions refuse it so (its chat streams the beams, whole, once found).
        if value and info.data.get("stream"):
            raise ValueError("Streaming is not currently supported with beam search")
        return value


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
    prompt_logprobs: PromptLogprobs | None = prompt_logprobs_field()  # vLLM's


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
