"""What the chat and completions endpoints share: request fields and the usage object.

Every field is bounded, so that whatever a client sends costs bounded work before the engine
sees it, and a value the engine cannot take is a 400 naming the field, never a 500. Batch lines
are checked with these models too, and unlike a request body they are not bounded in bytes by
`max_request_body_bytes`, so the text and free-form JSON fields carry bounds of their own.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pagedbatch.engine.beam_search import MAX_LENGTH_PENALTY
from pagedbatch.engine.core.request import MAX_USER_PRIORITY
from pagedbatch.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP_CHARS

MAX_STOP_SEQUENCES = 4  # OpenAI's bound; the engine's own (MAX_STOP_STRINGS) is looser
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Text a request may carry in one field: more than any model's context holds.
MAX_TEXT_CHARS = 2**21
MAX_NAME_CHARS = 256  # names and ids: `user`, message names, tool call ids
# Free-form JSON (JSON Schemas, tool parameters, ...): compiled into grammars or templated, so
# its nesting and size are bounded before anything walks it recursively.
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 20_000
# Python's JSON parser recurses once a level, so a document nested deeper than the interpreter's
# stack allows (about 1,000 levels, less the caller's frames) cannot be read at all, and one
# nested up to this deep always can: a refusal for depth says this much.
JSON_PARSE_DEPTH = 500
TOO_DEEP = f"it nests more than {JSON_PARSE_DEPTH} levels deep"

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _bounded_json(value: Any) -> Any:
    """`value`, if it nests at most MAX_JSON_DEPTH deep, holds at most MAX_JSON_VALUES values and
    no NaN or infinity (which Python's JSON parser accepts, and JSON does not have)."""
    pending = [(value, 1)]
    count = 0
    while pending:
        node, depth = pending.pop()
        count += 1
        if count > MAX_JSON_VALUES:
            raise ValueError(f"it holds more than {MAX_JSON_VALUES} values")
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, float) and not (-float("inf") < node < float("inf")):
            raise ValueError("it holds NaN or infinity, which JSON does not allow")
        if isinstance(node, dict):
            pending.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            pending.extend((child, depth + 1) for child in node)
    return value


# A JSON object of any shape, within the bounds above.
FreeJSON = Annotated[dict[str, Any], AfterValidator(_bounded_json)]


class RequestBody(BaseModel):
    """A request body. Unknown top-level fields are rejected: that catches typos (`max_token`)."""

    # No NaN or infinity in a float field: JSON has neither, though Python's parser accepts them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # A parameter sent as null is treated as not sent, as OpenAI does: it takes its default.
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # accepted; the stream is not obfuscated


class SamplingRequest(RequestBody):
    """Fields common to `/v1/chat/completions` and `/v1/completions`, with OpenAI's defaults."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: (
        StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None
    ) = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # OpenAI's seed is an int64
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: (
        Annotated[
            dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None

    # vLLM's extensions.
    top_k: int = Field(0, ge=-1, le=INT32_MAX)  # 0 or -1: no limit; beyond the vocabulary: none
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    # Each prompt token's logprob and the top k at its position (vLLM's max_logprobs bounds k).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The order among the caller's class of requests (realtime, or batch lines), lower first.
    priority: int = Field(0, ge=-MAX_USER_PRIORITY, le=MAX_USER_PRIORITY)
    # Beam search: `n` greedy beams, ranked by cumulative logprob over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int, info: ValidationInfo) -> int:
        # As vLLM: its stream chunks have no field for them, so a stream may ask for 0 (which
        # sends nothing) but not for more.
        if value is not None and value > 0 and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value


class PromptLogprob(BaseModel):
    """A token's logprob at a prompt position, in vLLM's shape (`prompt_logprobs` lists one dict
    per position, None for the first, from token id to this)."""

    logprob: float
    rank: int  # 1 = the likeliest token at the position
    decoded_token: str


# A position's prompt token and the top k there, by token id (keys are strings in JSON).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_field() -> Any:
    """A response's `prompt_logprobs`, there only where asked for: OpenAI's objects have no
    such field."""
    return Field(None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    audio_tokens: int = 0
    image_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )
