"""A request inside the engine and the state machine it moves through."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        # Identity tests: a set lookup would hash the member in Python, on every check.
        return (
            self is not RequestStatus.WAITING
            and self is not RequestStatus.RUNNING
            and self is not RequestStatus.PREEMPTED
        )


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}

_ALLOWED: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    },
    RequestStatus.PREEMPTED: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    },
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED} | _FINISHED,
    # A finished request whose output then cannot be completed (its held-back text fails to
    # decode) reports the error rather than a text it does not have.
    RequestStatus.FINISHED_STOPPED: {RequestStatus.FINISHED_ERROR},
    RequestStatus.FINISHED_LENGTH: {RequestStatus.FINISHED_ERROR},
    RequestStatus.FINISHED_ABORTED: {RequestStatus.FINISHED_ERROR},
}

# What the OpenAI API calls each way of finishing.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# The user priorities a request may have (vLLM's field is unbounded; these are plenty).
MAX_USER_PRIORITY = 1000


class IllegalTransition(RuntimeError):
    pass


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(eq=False)
class Request:
    """One completion's state in the engine; equal only to itself (the scheduler's queues find
    and remove requests by identity, without comparing their fields).

    Invariant: `all_token_ids == prompt_token_ids + output_token_ids`, kept by
    `append_output_token`, the only way output tokens are added, so that no step rebuilds it.

    A pooling request (an embedding's) has `pooling_params` and no `sampling_params`: it is
    prefill-only, never sampled, and finishes in the step that reaches its prompt's end, its
    `embedding` set.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first
    # vLLM's per-request `priority`: the order within a priority class (realtime, batch), lower
    # first, before arrival.
    user_priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time after which the request is aborted
    max_tokens: int = 0  # resolved by the engine from sampling_params and the context length
    cache_salt: str | None = None  # prefix-cache blocks are shared only between equal salts
    media: tuple[MediaItem, ...] = ()  # images and clips in prompt order, placeholders apart
    # A model with M-RoPE (Qwen2-VL): the prompt's positions, [3, prompt tokens], when images
    # make them other than the tokens' indices; later tokens sit at their index plus the delta.
    mrope_positions: np.ndarray | None = field(default=None, repr=False)
    mrope_delta: int = 0
    pooling_params: PoolingParams | None = None
    # A pooling request's: the model's pooling type ("mean", "cls", "last") and its output size.
    pooling_type: str | None = None
    dimensions: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model alone
    lora_id: int = 0  # that adapter's registration (unique: see lora.registry.Registered)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Whether this completion scores its prompt (`sampling_params.prompt_logprobs`; the first of
    # a request's completions does it for all), and the logprobs of prompt tokens 1, 2, ...
    # scored so far (see `sample.prompt_logprobs`).
    scores_prompt: bool = False
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The first token's raw logits row, float32, when `sampling_params.scores` asks for it.
    scores: torch.Tensor | None = field(default=None, repr=False)
    # A pooling request's: what the chunks computed so far contributed (a mean's running sum,
    # the first token's state), then its finished vector (1-D float32).
    pooled: torch.Tensor | None = field(default=None, repr=False)
    embedding: torch.Tensor | None = field(default=None, repr=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token or string that ended it
    error: str | None = None

    # Timing, monotonic seconds.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: the engine's own list, not a copy; do not modify it."""
        return self._all_token_ids

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def lora_key(self) -> str | None:
        """What its prefix-cache blocks are keyed by for its adapter: the name and the
        registration, so that a name loaded again with other weights shares none."""
        return None if self.lora_name is None else f"{self.lora_name}#{self.lora_id}"

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether cached KV may stand in for computing its prompt: not where pooling needs the
        hidden states of every token (a mean) or of the first (CLS), which the cache lacks; nor
        where the prompt is scored, which needs the logits of every position."""
        if self.scores_prompt:
            return False
        return self.pooling_type is None or self.pooling_type == "last"

    @property
    def sort_key(self) -> tuple[int, int, float]:
        """Scheduling order: lower priority number first, then lower user priority, then
        earlier arrival."""
        return (self.priority, self.user_priority, self.arrival_time)

    def transition(self, new: RequestStatus) -> None:
        if new not in _ALLOWED.get(self.status, set()):
            raise IllegalTransition(
                f"request {self.request_id}: {self.status.value} -> {new.value} is not allowed"
            )
        self.status = new
