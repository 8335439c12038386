"""What the engine hands back to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedbatch.engine.core.request import TokenLogprob


@dataclass
class CompletionOutput:
    """One of a request's `n` completions: everything so far or, for a request whose
    `output_kind` is DELTA, only what is new since its previous output.

    Cumulative `text` only grows: while a stop string could still be forming, its first
    characters are held back, so a streaming caller can send `text[len(sent):]` at every step
    (or, with DELTA, each `text` as it comes).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    # The first token's raw logits row (float32), when `SamplingParams.scores` asked for it; a
    # DELTA output carries it once, with the first token.
    scores: torch.Tensor | None = None
    # Why the service's content filter ended it (its finish_reason then "content_filter").
    refusal: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    queue_time: float | None = None  # arrival to first schedule, seconds
    ttft: float | None = None  # arrival to first token
    e2e: float | None = None  # arrival to finish
    mean_itl: float | None = None  # mean inter-token latency


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    num_image_tokens: int = 0  # prompt tokens that images' embeddings fill
    num_audio_tokens: int = 0  # prompt tokens that audio clips' embeddings fill
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Each prompt token's logprob (None for the first, which nothing precedes), when
    # `SamplingParams.prompt_logprobs` asked; set once the prompt has run (a DELTA request's
    # outputs carry it once).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding model's request: its vector (1-D float32, pooled, cut to the dimensions
    # asked for and normalized as asked), and `outputs` is empty. None where it did not finish
    # (aborted, timed out: `error` says which where it failed).
    embedding: torch.Tensor | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold `later`, the next DELTA output of the same request, into this one: for a caller
        that fell behind, what the two said in one output. Both must be DELTA outputs."""
        by_index = {completion.index: completion for completion in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            # A delta's lists are its own (the engine slices them per output): extended in
            # place, so folding many deltas costs what they carry, not their running total.
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(new.logprobs)
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
            if old.scores is None:
                old.scores = new.scores
            old.refusal = new.refusal or old.refusal
        self.outputs.sort(key=lambda completion: completion.index)
        self.finished = later.finished
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error
        self.metrics = later.metrics

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs
