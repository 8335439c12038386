"""`/v1/moderations`: the request (text, a list of texts, or content parts) and the scores.

A list of strings is scored string by string, one result each; a list of content parts is one
input, its text parts read together (OpenAI's multimodal form), with one result.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedbatch.protocol.schemas.chat import ImagePart, TextPart
from pagedbatch.protocol.schemas.common import Name, Text

# The most inputs one request may carry, whatever the settings allow (they may allow fewer).
MAX_MODERATION_INPUTS = 1024


InputPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ModerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_MODERATION_INPUTS)]
        | Annotated[list[InputPart], Field(min_length=1, max_length=MAX_MODERATION_INPUTS)]
    )
    model: Name | None = None  # None: the served guard


class Moderation(BaseModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[Literal["text", "image"]]]


class ModerationCreateResponse(BaseModel):
    id: str
    model: str
    results: list[Moderation]
