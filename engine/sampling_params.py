"""How one request is sampled: OpenAI's and vLLM's names, checked on construction."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedbatch.engine.sample.structured_output import StructuredOutput

# A logits processor sees the tokens generated so far and the request's logits row (1-D, float32)
# and returns the row to sample from (it may modify it in place). Structured output masks the
# logits before these run, batched, from `SamplingParams.structured`.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

# Greedy below this temperature: dividing by ~0 overflows and sampling degenerates anyway.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
# Bounds on what one request may ask of the engine, so that no request can make a step slow or
# large for everyone (the API checks the same limits, importing these).
MAX_N = 128  # completions per request: each is an engine request with its own KV cache
MAX_LOGIT_BIAS = 300  # OpenAI's own limit on logit_bias entries
LOGIT_BIAS_LIMIT = 100.0  # |bias|: OpenAI's range; beyond it a bias only bans or forces a token
MAX_STOP_STRINGS = 16  # every stop string is matched against every new character
MAX_STOP_CHARS = 256  # a stop string's length: the text held back while one may be forming


class RequestOutputKind(enum.Enum):
    """Which outputs the engine hands back for a request (vLLM's names)."""

    # Each step the request moves: everything so far (text, token ids, logprobs).
    CUMULATIVE = "cumulative"
    # Each step the request moves: only what is new since its previous output (for streams).
    DELTA = "delta"
    # One output, when the request finishes, with everything (for batch lines and offline runs).
    FINAL_ONLY = "final_only"


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
    # vLLM's: each prompt token's logprob and the top-k at its position (see
    # sample.prompt_logprobs); on the output as `prompt_logprobs`, None for the first token.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the named tokens' logits before sampling (OpenAI's logit_bias); the engine checks
    # the ids against the model's vocabulary.
    logit_bias: dict[int, float] | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    structured: StructuredOutput | None = None  # JSON, JSON Schema or tool calls the output obeys
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The raw logits row the first token is sampled from (before any mask, bias or penalty), on
    # the outputs as `scores`: a sequence classifier's label scores, a guard model's verdict.
    scores: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str, *got: object) -> ValueError:
            # `got`: the offending item of a list or dict, rather than all of it.
            value = got[0] if got else getattr(self, name)
            return ValueError(f"{name} {why}, got {value!r}")

        integers = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
        for name in integers:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(name, "must be an integer")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be between 1 and {MAX_N}")
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
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be positive and finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings", len(self.stop))
        if stops := [s for s in self.stop if not _is_stop(s)]:
            raise bad("stop", f"must hold strings of 1 to {MAX_STOP_CHARS} characters", stops[0])
        if tokens := [t for t in self.stop_token_ids if not _is_token_id(t)]:
            raise bad("stop_token_ids", "must hold non-negative token ids", tokens[0])
        bias = self.logit_bias
        if bias is not None:
            if len(bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} entries", len(bias))
            if tokens := [t for t in bias if not _is_token_id(t)]:
                raise bad("logit_bias", "must map non-negative token ids to biases", tokens[0])
            if tokens := [t for t, value in bias.items() if not _is_bias(value)]:
                limit = LOGIT_BIAS_LIMIT
                why = f"values must be between {-limit} and {limit}"
                raise bad("logit_bias", why, {tokens[0]: bias[tokens[0]]})
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if self.structured is not None and self.min_tokens:
            # The grammar decides where the output ends; a floor could leave nothing to sample.
            raise bad("min_tokens", "cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def _is_stop(value: object) -> bool:
    return isinstance(value, str) and 1 <= len(value) <= MAX_STOP_CHARS


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_bias(value: object) -> bool:
    # The range check also refuses NaN; booleans are not biases.
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT
    )
