"""Input processing: a caller's prompt and SamplingParams, checked and turned into engine requests.

Everything a caller can get wrong is refused here, with a ValueError naming the problem, before
the engine holds anything of the request. What passes becomes `n` requests (one per completion)
that share the prompt's token ids and can all run to their `max_tokens` within the model's
context and the KV cache.
"""

from __future__ import annotations

import time
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.kv_cache_manager import cdiv
from pagedbatch.engine.multimodal import ImageItem, ImageSpec, mrope_positions
from pagedbatch.engine.request import Request
from pagedbatch.engine.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        block_size: int,
        num_kv_blocks: int,
        image_spec: ImageSpec | None = None,
        max_image_tokens: int = 0,
    ):
        """`image_spec` for a model that reads images, each of at most `max_image_tokens`
        embeddings (what the encoder may do in a step and its cache hold)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.image_spec = image_spec
        self.max_image_tokens = max_image_tokens

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int,
        timeout: float | None,
        cache_salt: str | None,
        images: tuple[ImageItem, ...] = (),
    ) -> list[Request]:
        """The request's completions, `{request_id}#{i}` for i < n; a seeded request's i-th
        completion has seed + i, so that they differ yet each reproduces."""
        prompt_ids = self._encode(prompt)
        self._check_images(prompt_ids, images)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        self._check_vocabulary(params)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        positions, delta = None, 0
        if images and self.image_spec.mrope:  # once every check has passed
            positions, delta = mrope_positions(len(prompt_ids), images, self.image_spec.merge)
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
                    arrival_time=now,
                    deadline=now + timeout if timeout is not None else None,
                    max_tokens=max_tokens,
                    cache_salt=cache_salt,
                    images=tuple(images),
                    mrope_positions=positions,
                    mrope_delta=delta,
                )
            )
        return children

    def _check_images(self, prompt_ids: list[int], images: tuple[ImageItem, ...]) -> None:
        """Each image fills a run of image tokens of its own, in order, with pixel values the
        model reads; no image token of the prompt is left without one."""
        spec = self.image_spec
        if spec is None:
            if images:
                raise ValueError("this model reads text only: it takes no images")
            return
        image_token = spec.token_id
        covered = 0
        previous_end = 0
        for i, item in enumerate(images):
            if not isinstance(item, ImageItem):
                raise ValueError(f"images[{i}] is not an ImageItem")
            try:
                tokens = spec.tokens_for(item.pixel_values, item.grid)
            except ValueError as e:
                raise ValueError(f"images[{i}]: {e}") from None
            if item.length != tokens:
                raise ValueError(
                    f"images[{i}] has {item.length} placeholders; this model gives it {tokens} "
                    "embeddings"
                )
            if not bool(item.pixel_values.isfinite().all()):
                raise ValueError(f"images[{i}] has pixel values that are not finite")
            if item.length > self.max_image_tokens:
                raise ValueError(
                    f"images[{i}] takes {item.length} embeddings, more than the encoder's "
                    f"budget and cache allow ({self.max_image_tokens})"
                )
            if item.offset < previous_end or item.end > len(prompt_ids):
                raise ValueError(f"images[{i}] overlaps another or lies beyond the prompt")
            if any(t != image_token for t in prompt_ids[item.offset : item.end]):
                raise ValueError(f"images[{i}] does not lie on image tokens of the prompt")
            covered += item.length
            previous_end = item.end
        if prompt_ids.count(image_token) != covered:
            raise ValueError("the prompt holds image tokens that no image fills")

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
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
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {prompt_len} tokens"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} and max_tokens asks for {params.max_tokens} more"
            )
        max_tokens = params.max_tokens or room
        blocks = cdiv(prompt_len + max_tokens, self.block_size)
        if blocks > self.num_kv_blocks:
            raise ValueError(
                f"prompt plus max_tokens ({prompt_len + max_tokens} tokens) exceeds the KV cache "
                f"({self.num_kv_blocks * self.block_size} tokens)"
            )
        return max_tokens
