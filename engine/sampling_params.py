"""How one request is sampled: OpenAI's and vLLM's names, checked on construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedbatch.engine.structured_output import StructuredOutput

# A logits processor sees the tokens generated so far and the request's logits row (1-D, float32)
# and returns the row to sample from (it may modify it in place). Structured output masks the
# logits before these run, batched, from `SamplingParams.structured`.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

# Greedy below this temperature: dividing by ~0 overflows and sampling degenerates anyway.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token; 0 = the sampled token only
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    structured: StructuredOutput | None = None  # JSON, JSON Schema or tool calls the output obeys

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be between 0 and 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be between -2 and 2")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be positive")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative token ids")
        if self.structured is not None and self.min_tokens:
            # The grammar decides where the output ends; a floor could leave nothing to sample.
            raise bad("min_tokens", "cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
