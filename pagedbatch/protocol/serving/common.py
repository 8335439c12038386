"""What the chat and completions endpoints do alike, free of any web framework.

An endpoint turns a validated request into `Prepared`: the engine requests to run (`inputs`) and
a way to turn their final outputs into the response body. The realtime router and the batch
runner drive the engine themselves and meet only this interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedbatch.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from pagedbatch.engine.input_processor import fits_context
from pagedbatch.engine.multimodal.audio import AudioProcessor
from pagedbatch.engine.multimodal.images import ImageProcessor
from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sample.structured_output import StructuredOutput
from pagedbatch.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedbatch.ids import new_id, now  # noqa: F401 - used by the chat and completions layers
from pagedbatch.protocol.errors import OpenAIError, from_validation_error
from pagedbatch.protocol.schemas.common import (
    CompletionTokensDetails,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
)
from pagedbatch.protocol.structured_output import costly_output_format

Body = TypeVar("Body", bound=BaseModel)

# Engine priorities, lower first: realtime requests go ahead of batch lines, and batch lines are
# the ones preempted when realtime traffic needs KV blocks or batch slots.
REALTIME_PRIORITY = 0
BATCH_PRIORITY = 10


class Pooling(Protocol):
    """What serving reads of a pooling model's config."""

    dimensions: int  # the size of its vectors

    def check_dimensions(self, dimensions: int | None) -> int:
        """The size of the vectors asked for (None: the full size); ValueError, saying why,
        where the model cannot give vectors of `dimensions` values."""


class ServedModel(Protocol):
    """What serving needs to know of the engine it prepares requests for."""

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    model_name: str
    reasoning_tags: tuple[str, str] | None  # what a reasoning model thinks between
    labels: list[str] | None  # a sequence classifier's labels; None: a language model
    image_processor: ImageProcessor | None  # None: the model takes no images
    audio_processor: AudioProcessor | None  # None: the model takes no audio
    pooling: Pooling | None  # an embedding model's pooling; None: it generates
    lora_names: tuple[str, ...]  # the LoRA adapters served on it, each requested as a model


@dataclass
class EngineInput:
    """One engine request: `engine.add_request(request_id, prompt_token_ids, params, ...,
    media=media)`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding, nothing generated
    media: tuple[MediaItem, ...] = ()
    user_priority: int = 0  # vLLM's `priority`: its order within its door's priority
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model
    beam: BeamSearchParams | None = None  # a beam search's (`params` then say its n, logprobs)

    @property
    def generates(self) -> bool:
        return isinstance(self.params, SamplingParams)


class Prepared(Protocol):
    inputs: list[EngineInput]

    def input_texts(self) -> list[str]:
        """What the content filter screens of the request's input: each text a user wrote."""

    def response(self, outputs: Sequence[RequestOutput]) -> BaseModel | str:
        """The response body from the final output of each of `inputs`, in the same order: an
        object sent as JSON, or text sent as text/plain.

        Raises OpenAIError if a request ended in an error or was aborted.
        """


def worst_case_tokens(prepared: Prepared, max_model_len: int) -> tuple[int, int]:
    """The most tokens `prepared` can take: its prompts', and for each of their n choices
    max_tokens, or without it the context its prompt leaves (what spend limits reserve); an
    embedding generates none."""
    prompt = sum(len(i.prompt_token_ids) for i in prepared.inputs)
    output = sum(
        i.params.n * (i.params.max_tokens or max(0, max_model_len - len(i.prompt_token_ids)))
        for i in prepared.inputs
        if isinstance(i.params, SamplingParams)
    )
    return prompt, output


def parse_request(schema: type[Body], body: Any) -> Body:
    """`body` (decoded JSON) validated as `schema`; OpenAIError 400 naming the bad field."""
    _check_unicode(body)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, body) from None


def _check_unicode(body: Any) -> None:
    """A 400 naming the first string (or key) that holds a lone surrogate: JSON's `\\ud800`
    escape decodes to one, and it is no Unicode text, which neither tokenizers nor an error
    message that quotes it (as UTF-8) can take."""
    # Each entry: a value and where it is, as (where its parent is, its key or index); the path
    # is spelled out only for a value at fault.
    pending: list[tuple[Any, _Where]] = [(body, None)]
    while pending:
        node, where = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not _encodable(key):
                    _bad_text(where)
                if isinstance(value, dict | list | str):
                    pending.append((value, (where, key)))
        elif isinstance(node, list):
            pending.extend(
                (item, (where, i))
                for i, item in enumerate(node)
                if isinstance(item, dict | list | str)
            )
        elif isinstance(node, str) and not _encodable(node):
            _bad_text(where)


_Where = tuple[Any, int | str] | None


def _path(where: _Where) -> str | None:
    steps: list[int | str] = []
    while where is not None:
        where, step = where
        steps.append(step)
    path: str | None = None
    for step in reversed(steps):
        path = (
            f"{path or ''}[{step}]"
            if isinstance(step, int)
            else (step if path is None else f"{path}.{step}")
        )
    return path


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _bad_text(where: _Where) -> None:
    # Keys are checked before what they hold, so a path never holds a surrogate itself.
    param = _path(where)
    prefix = "" if param is None else f"Invalid value for '{param}': "
    raise OpenAIError(
        f"{prefix}it holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode.",
        param=param,
        code="invalid_value",
    )


def check_model(requested: str, served: ServedModel) -> str | None:
    """The LoRA adapter requested (None: the model itself); a 404 unless `served` is the model
    requested or serves an adapter of that name; a 400 if it is an embedding model, which
    generates nothing (the endpoints that call this generate)."""
    if requested in served.lora_names:
        return requested
    if requested != served.model_name:
        raise model_not_found(requested)
    if served.pooling is not None:
        raise OpenAIError(
            f"The model `{requested}` is an embedding model: it serves /v1/embeddings only, and "
            "generates no text.",
            param="model",
            code="model_not_supported",
        )
    return None


def model_not_found(requested: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{requested}` does not exist or you do not have access to it.",
        status_code=404,
        param="model",
        code="model_not_found",
    )


def not_supported(what: str, param: str) -> OpenAIError:
    return OpenAIError(f"{what} is not supported yet.", param=param, code="unsupported_parameter")


def check_context_length(
    prompt_tokens: int,
    max_tokens: int | None,
    served: ServedModel,
    *,
    param: str,
    at_least: bool = False,
) -> None:
    """400 `context_length_exceeded` unless the prompt leaves room for `max_tokens` (or one).
    `at_least`: the prompt has at least `prompt_tokens` tokens, how many more is not known."""
    limit = served.max_model_len
    if fits_context(prompt_tokens, max_tokens, limit):
        return
    counted = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    if max_tokens is None:
        detail = f"your {param} resulted in {counted} tokens, leaving none for the completion"
    else:
        requested = prompt_tokens + max_tokens
        detail = (
            f"you requested {'at least ' if at_least else ''}{requested} tokens "
            f"({counted} in the {param}, {max_tokens} in the completion)"
        )
    raise OpenAIError(
        f"This model's maximum context length is {limit} tokens. However, {detail}. "
        f"Please reduce the length of the {param} or completion.",
        param=param,
        code="context_length_exceeded",
    )


# A prompt text longer than this many characters is first counted a piece at a time, each piece
# cut at a space where one is near, stopping as soon as the count leaves no room in the context.
PIECE_CHARS = 1 << 16
# What one cut between pieces may add to their count over the whole text's: a token (or an added
# token such as <|im_start|>) cut in two, or a prefix space a SentencePiece tokenizer adds to the
# next piece. Measured: about 2 a cut on byte-level BPE for cuts inside words.
CUT_SLACK_TOKENS = 8


def encode_prompt(
    text: str,
    max_tokens: int | None,
    served: ServedModel,
    *,
    param: str,
    add_special_tokens: bool,
) -> list[int]:
    """`text`'s token ids, or a 400 `context_length_exceeded` found without tokenizing all of a
    text far past the context.

    Tokenizing costs time and memory in proportion to the text (tens of bytes of Python objects a
    token): a text of PIECE_CHARS or fewer is tokenized whole; a longer one is counted piece by
    piece first, and refused once its count, less CUT_SLACK_TOKENS a cut, leaves no room for
    `max_tokens` (or one token). So a prompt costs at most about a context's worth of
    tokenizing, and a piece's memory, beyond what it takes to tokenize one that fits. The ids
    still get `check_context_length`'s exact check after (with media placed, for a chat).
    """
    tokenizer = served.tokenizer
    most = served.max_model_len - (1 if max_tokens is None else max_tokens)
    if len(text) > PIECE_CHARS:
        at_least = _count_past(tokenizer, text, most)
        if at_least > most:
            check_context_length(at_least, max_tokens, served, param=param, at_least=True)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _count_past(tokenizer: PreTrainedTokenizerBase, text: str, most: int) -> int:
    """A count of `text`'s tokens that it has at least, allowing for the cuts: exact enough up to
    `most`, and as soon as it passes `most` the counting stops."""
    counted = cuts = start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            # Before the last space or newline of the piece's second half: where byte-level
            # BPE's pre-tokenizers split anyway, so the pieces' tokens are the whole text's.
            half = start + PIECE_CHARS // 2
            space = max(text.rfind(" ", half, end), text.rfind("\n", half, end))
            end = space if space > start else end
            cuts += 1
        counted += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if counted - CUT_SLACK_TOKENS * cuts > most:
            break
        start = end
    return max(0, counted - CUT_SLACK_TOKENS * cuts)


def sampling_params(
    request: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    tokenizer: PreTrainedTokenizerBase,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    vocab_size = len(tokenizer)
    top_p, top_k = request.top_p, request.top_k
    if top_k >= vocab_size:  # every token is among the top k: no limit
        top_k = 0
    if top_p == 0.0:  # OpenAI allows it: only the most likely token is left, which is top-k 1
        top_p, top_k = 1.0, 1
    if request.logit_bias:
        check_vocabulary(request.logit_bias, vocab_size, param="logit_bias")
    try:
        return SamplingParams(
            n=request.n,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            temperature=request.temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=request.min_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            stop=request.stop,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            # A stream's chunks carry none (as vLLM's), so none are computed for one.
            prompt_logprobs=None if request.stream else request.prompt_logprobs,
            logit_bias=request.logit_bias,
            structured=structured,
            # A stream is sent piece by piece; anything else is answered whole.
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )
    except ValueError as exc:  # combinations the schema does not check, e.g. min_tokens > max
        raise OpenAIError(str(exc), code="invalid_value") from None


def beam_params(
    request: SamplingRequest, max_tokens: int | None, prompt_tokens: int, served: ServedModel
) -> BeamSearchParams | None:
    """The beam search `use_beam_search` asks for, `n` beams wide; None where it does not."""
    if not request.use_beam_search:
        return None
    if request.n > MAX_BEAM_WIDTH:
        raise OpenAIError(
            f"Invalid value for 'n': beam search runs at most {MAX_BEAM_WIDTH} beams, got "
            f"{request.n}.",
            param="n",
            code="invalid_value",
        )
    if request.prompt_logprobs is not None:
        raise not_supported("prompt_logprobs with beam search", "prompt_logprobs")
    return BeamSearchParams(
        beam_width=request.n,
        max_tokens=max_tokens or served.max_model_len - prompt_tokens,
        ignore_eos=request.ignore_eos,
        length_penalty=request.length_penalty,
    )


def check_vocabulary(token_ids: Iterable[int], vocab_size: int, *, param: str) -> None:
    unknown = sorted({t for t in token_ids if t >= vocab_size})
    if unknown:
        raise OpenAIError(
            f"Invalid value for '{param}': token ids {unknown[:5]} are outside the vocabulary "
            f"(size {vocab_size}).",
            param=param,
            code="invalid_value",
        )


def prefix_cache_salt(share: bool, owner: str) -> str | None:
    """The engine's `cache_salt` for `owner`'s requests: KV blocks cached for one salt are never
    found by a request with another, so a tenant cannot tell from its cached_tokens (or from how
    fast its first token comes) what another tenant's prompts began with. None shares the cache
    among all (`share_prefix_cache_across_tenants`)."""
    return None if share else owner


FinishReason = Literal["stop", "length", "content_filter"]


def finish_reason(choice: CompletionOutput, output: RequestOutput) -> FinishReason:
    """OpenAI's finish_reason; an aborted or failed request is an error response instead."""
    if choice.finish_reason in ("stop", "length", "content_filter"):
        return choice.finish_reason
    if choice.finish_reason == "abort":
        raise OpenAIError(
            "The request was aborted before it finished.",
            status_code=503,
            type="server_error",
            code="request_aborted",
        )
    if (costly := costly_output_format(output.error)) is not None:
        raise costly  # the client's schema or tools, not the engine, are at fault
    raise OpenAIError(
        f"The request failed in the engine: {output.error or 'no reason given'}.",
        status_code=500,
        type="server_error",
    )


def usage(outputs: Sequence[RequestOutput], reasoning: int = 0) -> Usage:
    """The usage of finished, whole (not DELTA) outputs, `reasoning` of their tokens thinking."""
    return counted_usage(
        prompt=sum(len(o.prompt_token_ids) for o in outputs),
        completion=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        cached=sum(o.num_cached_tokens for o in outputs),
        images=sum(o.num_image_tokens for o in outputs),
        audio=sum(o.num_audio_tokens for o in outputs),
        reasoning=reasoning,
    )


def counted_usage(
    prompt: int, completion: int, cached: int, images: int = 0, audio: int = 0, reasoning: int = 0
) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached, image_tokens=images, audio_tokens=audio
        ),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
    )


# Byte-level BPE spells each byte as one printable character; this maps it back.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenPieces:
    """Each token's bytes and text, as OpenAI's logprobs report them.

    A token may hold part of a multi-byte character: its `bytes` are exact, its text shows the
    missing part as U+FFFD, and the bytes of consecutive tokens join into the exact text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        added = tokenizer.added_tokens_decoder
        self._added = {i: t.content for i, t in added.items()}
        # The tokens that the output text leaves out (the engine skips special tokens).
        self.special = frozenset(i for i, t in added.items() if t.special)

    def bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return self._tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode(errors="replace")
