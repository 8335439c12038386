"""Input processing: a caller's prompt and SamplingParams, checked and turned into engine requests.

Everything a caller can get wrong is refused here, with a ValueError naming the problem, before
the engine holds anything of the request. What passes becomes `n` requests (one per completion)
that share the prompt's token ids and can all run to their `max_tokens` within the model's
context and the KV cache. An embedding model's request (PoolingParams) becomes one request whose
prompt fits the context.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.config import PoolingConfig
from pagedbatch.engine.core.request import MAX_USER_PRIORITY, Request
from pagedbatch.engine.multimodal.images import ImageSpec, mrope_positions
from pagedbatch.engine.multimodal.inputs import MediaItem, MediaSpec
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sampling_params import SamplingParams


def fits_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> bool:
    """Whether a prompt of `prompt_len` tokens leaves room in the context for `max_tokens`, or
    without it for one token: the one rule that the engine and the API's 400
    `context_length_exceeded` (protocol/serving/common.py) both apply."""
    room = max_model_len - prompt_len
    return room >= 1 if max_tokens is None else max_tokens <= room


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        media_specs: Sequence[MediaSpec] = (),
        max_media_tokens: int = 0,
        pooling: PoolingConfig | None = None,
    ):
        """`media_specs` for a model that reads images or audio, each item of at most
        `max_media_tokens` embeddings (what the encoder may do in a step and its cache hold);
        `pooling` for an embedding model, which takes PoolingParams (and nothing else)."""
        self.pooling = pooling
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.media_specs: dict[str, MediaSpec] = {spec.modality: spec for spec in media_specs}
        self.max_media_tokens = max_media_tokens

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        timeout: float | None,
        cache_salt: str | None,
        media: tuple[MediaItem, ...] = (),
        user_priority: int = 0,
    ) -> list[Request]:
        """The request's completions, `{request_id}#{i}` for i < n; a seeded request's i-th
        completion has seed + i, so that they differ yet each reproduces."""
        self._check_params_kind(params)
        _check_user_priority(user_priority)
        prompt_ids = self._encode(prompt)
        if isinstance(params, PoolingParams):
            return [
                self._pooling_request(
                    request_id, prompt_ids, params, priority, timeout, cache_salt, media
                )
            ]
        self._check_media(prompt_ids, media)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        self._check_vocabulary(params)
        _check_timeout_and_salt(timeout, cache_salt)
        positions, delta = None, 0
        images = self.media_specs.get("image")
        if media and isinstance(images, ImageSpec) and images.mrope:  # once every check passed
            positions, delta = mrope_positions(len(prompt_ids), media, images.merge)
        now = time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)
            children.append(
                Request(
                    request_id=f"{request_id}#{i}",
                    prompt_token_ids=prompt_ids,
                    sampling_params=child_params,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    user_priority=user_priority,
                    arrival_time=now,
                    deadline=now + timeout if timeout is not None else None,
                    max_tokens=max_tokens,
                    cache_salt=cache_salt,
                    media=tuple(media),
                    mrope_positions=positions,
                    mrope_delta=delta,
                    scores_prompt=i == 0 and params.prompt_logprobs is not None,
                )
            )
        return children

    def _check_params_kind(self, params: SamplingParams | PoolingParams) -> None:
        """An embedding model takes PoolingParams; a model that generates, SamplingParams."""
        if self.pooling is not None and not isinstance(params, PoolingParams):
            raise ValueError(
                "this is an embedding model: it takes PoolingParams, not "
                f"{type(params).__name__} (it generates no text)"
            )
        if self.pooling is None and not isinstance(params, SamplingParams):
            raise ValueError(
                "this model generates text: it takes SamplingParams, not "
                f"{type(params).__name__} (it is not an embedding model)"
            )

    def _pooling_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: PoolingParams,
        priority: int,
        timeout: float | None,
        cache_salt: str | None,
        media: tuple[MediaItem, ...],
    ) -> Request:
        """An embedding request: its prompt within the context, the output size it asks for
        one the model allows."""
        assert self.pooling is not None
        if media:
            raise ValueError("an embedding model takes no images or audio")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the input "
                f"has {len(prompt_ids)}"
            )
        dimensions = self.pooling.check_dimensions(params.dimensions)
        _check_timeout_and_salt(timeout, cache_salt)
        now = time.monotonic()
        return Request(
            request_id=f"{request_id}#0",
            prompt_token_ids=prompt_ids,
            sampling_params=None,
            priority=priority,
            arrival_time=now,
            deadline=now + timeout if timeout is not None else None,
            cache_salt=cache_salt,
            pooling_params=params,
            pooling_type=self.pooling.pooling_type,
            dimensions=dimensions,
        )

    def _check_media(self, prompt_ids: list[int], media: tuple[MediaItem, ...]) -> None:
        """Each image or clip fills a run of its modality's placeholder tokens of its own, in
        order, with values the model reads; no placeholder of the prompt is left without one."""
        covered: Counter[int] = Counter()
        previous_end = 0
        for i, item in enumerate(media):
            if not isinstance(item, MediaItem):
                raise ValueError(f"media[{i}] is not a MediaItem")
            spec = self.media_specs.get(item.modality)
            if spec is None:
                raise ValueError(f"this model takes no {item.modality} input")
            what = f"media[{i}] ({item.modality})"
            try:
                tokens = spec.tokens_for(item)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
            if item.length != tokens:
                raise ValueError(
                    f"{what} has {item.length} placeholders; this model gives it {tokens} "
                    "embeddings"
                )
            if not bool(item.values.isfinite().all()):
                raise ValueError(f"{what} has values that are not finite")
            if item.length > self.max_media_tokens:
                raise ValueError(
                    f"{what} takes {item.length} embeddings, more than the encoder's "
                    f"budget and cache allow ({self.max_media_tokens})"
                )
            if item.offset < previous_end or item.end > len(prompt_ids):
                raise ValueError(f"{what} overlaps another or lies beyond the prompt")
            if any(t != spec.token_id for t in prompt_ids[item.offset : item.end]):
                raise ValueError(f"{what} does not lie on its placeholder tokens")
            covered[spec.token_id] += item.length
            previous_end = item.end
        for spec in self.media_specs.values():
            if prompt_ids.count(spec.token_id) != covered[spec.token_id]:
                raise ValueError(
                    f"the prompt holds {spec.modality} placeholder tokens that nothing fills"
                )

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            # Checked by C loops (type, min, max): an embedding batch sends thousands of prompts.
            if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids in the params must name rows of the logits (SamplingParams checks the rest)."""
        vocab = self.vocab_size
        named = {"stop_token_ids": params.stop_token_ids, "logit_bias": params.logit_bias}
        for name, ids in named.items():
            bad = next((t for t in ids or () if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"{name} holds token id {bad}, outside the vocabulary (size {vocab})"
                )

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if not fits_context(prompt_len, params.max_tokens, self.max_model_len):
            asked = "at least 1" if params.max_tokens is None else str(params.max_tokens)
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} and max_tokens asks for {asked} more"
            )
        # max_model_len is at most what the KV cache holds: the request fits it whole.
        return params.max_tokens or self.max_model_len - prompt_len


def _check_user_priority(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_USER_PRIORITY:
        raise ValueError(
            f"user_priority must be an integer between {-MAX_USER_PRIORITY} and "
            f"{MAX_USER_PRIORITY}, got {value!r}"
        )


def _check_timeout_and_salt(timeout: float | None, cache_salt: str | None) -> None:
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
