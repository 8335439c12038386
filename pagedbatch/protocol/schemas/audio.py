"""`/v1/audio/transcriptions`: a form's fields, and the transcription.

The form is multipart, as OpenAI's: `file` (the audio, bounded by the route's body limit) and
text fields, each bounded like any request field. Fields we do not implement
(`timestamp_granularities`, `include`, `chunking_strategy`) are accepted and ignored, as in
the chat request.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# What a transcription's prompt may carry: OpenAI's models read its last 224 tokens.
MAX_PROMPT_CHARS = 4096


class TranscriptionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    file: Annotated[bytes, Field(repr=False, exclude=True)]  # the audio file's bytes
    model: Annotated[str, Field(min_length=1, max_length=256)]
    # ISO-639-1 (or -3) code: "en", "de", "yue".
    language: Annotated[str, Field(pattern=r"^[a-z]{2,3}$")] | None = None
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    response_format: Literal["json", "text"] = "json"
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    stream: bool = False


class InputTokenDetails(BaseModel):
    text_tokens: int
    audio_tokens: int


class TranscriptionUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_token_details: InputTokenDetails


class Transcription(BaseModel):
    text: str
    usage: TranscriptionUsage
