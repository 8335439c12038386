"""`/v1/embeddings`: each input becomes one pooling request (prefill only, nothing generated),
and its pooled vector one `data` item, in the order the inputs came.

Texts are tokenized as sentence-transformers tokenizes them, with the model's special tokens
(`[CLS] ... [SEP]` for BERT). Every input must fit the model's context whole: a longer one is a
400 `context_length_exceeded` naming it (`input`, or `input[3]` among several), as OpenAI
answers, rather than silently cut as sentence-transformers would. A text longer than PIECE_CHARS
characters is counted a piece at a time and refused once past the context (`encode_prompt`), so
no input costs much more tokenizing than the larger of a context and PIECE_CHARS characters; the
texts are tokenized one at a time, stopping at the first refused; and the tokens of all the
inputs are bounded (MAX_EMBEDDING_TOKENS, OpenAI's), so that one request's engine work is.

`dimensions` asks for shorter vectors: a Matryoshka model's allowed sizes (the first values,
renormalized), or the model's full size; anything else is a 400 naming `dimensions`. Usage is
the inputs' tokens: `prompt_tokens` and `total_tokens` alike, and it is charged at the model's
input price. Embedding inputs are not screened by the content filter (protocol/pipeline.py).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.ids import new_id
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.embeddings import (
    CreateEmbeddingResponse,
    Embedding,
    EmbeddingRequest,
    EmbeddingUsage,
)
from pagedbatch.protocol.serving.common import (
    EngineInput,
    ServedModel,
    check_context_length,
    check_vocabulary,
    encode_prompt,
    model_not_found,
)

# OpenAI's bound on the tokens of all of one request's inputs together.
MAX_EMBEDDING_TOKENS = 300_000


@dataclass
class PreparedEmbedding:
    model: str
    encoding_format: str  # "float" or "base64"
    inputs: list[EngineInput]

    def input_texts(self) -> list[str]:
        # Not screened: nothing is generated for anyone to read, and OpenAI does not moderate
        # embedding inputs either.
        return []

    def response(self, outputs: Sequence[RequestOutput]) -> CreateEmbeddingResponse:
        tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return CreateEmbeddingResponse(
            data=[
                Embedding(index=i, embedding=self._encoded(output))
                for i, output in enumerate(outputs)
            ],
            model=self.model,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    def _encoded(self, output: RequestOutput) -> list[float] | str:
        vector = output.embedding
        if vector is None or output.error is not None:
            raise OpenAIError(
                f"The request failed in the engine: {output.error or 'it gave no embedding'}.",
                status_code=500,
                type="server_error",
            )
        values = vector.float().numpy()
        if self.encoding_format == "base64":
            # The SDK decodes it with numpy.frombuffer(..., dtype="float32"): little-endian.
            return base64.b64encode(values.astype("<f4", copy=False).tobytes()).decode()
        return values.tolist()


def prepare_embedding(request: EmbeddingRequest, served: ServedModel) -> PreparedEmbedding:
    """One pooling request per input; OpenAIError for what cannot be embedded."""
    if request.model != served.model_name:
        raise model_not_found(request.model)
    pooling = served.pooling
    if pooling is None:
        raise OpenAIError(
            f"The model `{request.model}` generates text and gives no embeddings; use an "
            "embedding model (PAGEDBATCH_EMBEDDING_MODEL serves one beside it).",
            param="model",
            code="model_not_supported",
        )
    try:
        size = pooling.check_dimensions(request.dimensions)
    except ValueError as exc:
        raise OpenAIError(
            f"Invalid value for 'dimensions': {exc}.", param="dimensions", code="invalid_value"
        ) from None
    # The full vector is cut nowhere.
    params = PoolingParams(dimensions=None if size == pooling.dimensions else size)
    id_ = new_id("embd-")
    token_ids = _token_ids(request, served)
    inputs = [EngineInput(f"{id_}-{i}", ids, params) for i, ids in enumerate(token_ids)]
    return PreparedEmbedding(served.model_name, request.encoding_format, inputs)


def _token_ids(request: EmbeddingRequest, served: ServedModel) -> list[list[int]]:
    """Each input's token ids, each checked against the vocabulary and the context, and their
    total against MAX_EMBEDDING_TOKENS."""
    given = request.input
    several = not isinstance(given, str) and not isinstance(given[0], int)
    inputs: list[str | list[int]] = list(given) if several else [given]  # type: ignore[list-item]
    params = [f"input[{i}]" if several else "input" for i in range(len(inputs))]
    tokenizer = served.tokenizer
    token_ids, total = [], 0
    for item, param in zip(inputs, params, strict=True):
        # One text at a time, on this thread: a batch call would tokenize on every core, outside
        # the tenant's share of the preparation threads, and all of the texts before the first
        # that is refused.
        if isinstance(item, str):
            ids = encode_prompt(item, 0, served, param=param, add_special_tokens=True)
        else:
            ids = item
            check_vocabulary(ids, len(tokenizer), param=param)
        check_context_length(len(ids), 0, served, param=param)
        total += len(ids)
        if total > MAX_EMBEDDING_TOKENS:
            raise OpenAIError(
                f"The inputs of one embedding request may hold at most {MAX_EMBEDDING_TOKENS} "
                f"tokens together; these hold more than that by {param}. Send fewer inputs a "
                "request, or use the Batch API.",
                param="input",
                code="invalid_value",
            )
        token_ids.append(ids)
    return token_ids
