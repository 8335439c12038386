"""`POST /v1/embeddings`: texts or token ids in, one vector each out, in OpenAI's shapes
(`openai.types.EmbeddingCreateParams`, `CreateEmbeddingResponse`).

`input` is one text, a list of texts, one list of token ids or a list of them: at most
MAX_EMBEDDING_INPUTS inputs, none empty (OpenAI's limits). How long each may be is the model's
context, which serving checks (protocol/serving/embeddings.py); the bounds here keep what the
schema itself walks bounded, as every request schema's do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from pagedbatch.protocol.schemas.common import (
    INT32_MAX,
    MAX_TEXT_CHARS,
    Name,
    RequestBody,
    TokenId,
)
from pagedbatch.protocol.schemas.completions import MAX_PROMPT_TOKENS

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's: inputs one request may carry
MAX_BATCH_EMBEDDING_INPUTS = 50_000  # OpenAI's: inputs all the lines of one batch may carry

EmbeddingText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
EmbeddingTokens = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]

EmbeddingInput = (
    EmbeddingText
    | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    | EmbeddingTokens
    | Annotated[list[EmbeddingTokens], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
)


class EmbeddingRequest(RequestBody):
    input: EmbeddingInput
    model: Name
    # `base64`: each vector's little-endian float32 bytes, as the SDK asks by default and decodes.
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)  # the model says which it allows
    user: Name | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _at_most_inputs(cls, value: Any) -> Any:
        # Before the union: past it each branch would report its own failure, and the error
        # would name an item instead of the list.
        several = isinstance(value, list) and value and not isinstance(value[0], int)
        if several and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"it holds {len(value)} inputs, and a request may hold at most "
                f"{MAX_EMBEDDING_INPUTS}"
            )
        return value

    @property
    def stream(self) -> bool:
        """Never streamed (the realtime door asks every request, api/realtime.py)."""
        return False


def input_count(given: Any) -> int:
    """How many inputs a body's `input` holds (one text or token list, or a list of them), as a
    batch counts them; whatever it is, it is counted, the body's own checks come later."""
    several = isinstance(given, list) and given and not isinstance(given[0], int)
    return len(given) if several else 1


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
