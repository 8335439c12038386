"""Beam search, as vLLM v1 runs it: an orchestration over the engine, not a mode of it.

Each step runs every live beam as a request of one token (greedy, `2 * beam_width` logprobs) and
extends each beam by those candidates; the `beam_width` likeliest extensions (by cumulative
logprob) live on, and an extension that ends in an end-of-sequence token is complete. The beams'
requests share their prompt (and the tokens the beams share) through the prefix cache, so a step
costs about a block's prefill per beam. The search ends after `max_tokens` steps or, as
transformers' `early_stopping=True`, once `beam_width` beams are complete; what is left is ranked
by cumulative logprob over generated length to the power `length_penalty`, the end token counted,
as transformers ranks its hypotheses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.engine.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from pagedbatch.engine.async_llm import AsyncLLM

# Each step asks for the top 2 * beam_width logprobs of every beam; MAX_LOGPROBS bounds that.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
MAX_LENGTH_PENALTY = 10.0


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be between {-MAX_LENGTH_PENALTY} and {MAX_LENGTH_PENALTY}, "
                f"got {self.length_penalty!r}"
            )


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` holds the prompt, then what the beam generated."""

    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token
    cum_logprob: float = 0.0
    text: str | None = None  # the generated text (an end token left out), once finished
    finish_reason: str | None = None  # "stop" (an end token) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: `prompts()` are the beams to run one token further, `advance` takes
    each one's top logprobs, in the same order, until `done`."""

    def __init__(
        self, prompt: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]
    ) -> None:
        self.params = params
        self.prompt_len = len(prompt)
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.live = [BeamSearchSequence(list(prompt))]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def step_params(self) -> SamplingParams:
        """What each beam's request of a step runs with."""
        width = 2 * self.params.beam_width
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=width, ignore_eos=True)

    @property
    def done(self) -> bool:
        return (
            self.steps >= self.params.max_tokens
            or not self.live
            or len(self.complete) >= self.params.beam_width
        )

    def prompts(self) -> list[list[int]]:
        return [beam.tokens for beam in self.live]

    def advance(self, tops: Sequence[TokenLogprob]) -> None:
        """Extend each live beam by the candidates of its step's `TokenLogprob`."""
        extended: list[BeamSearchSequence] = []
        for beam, step in zip(self.live, tops, strict=True):
            for rank, (token, logprob) in enumerate(step.top, start=1):
                chosen = TokenLogprob(token, logprob, rank, step.top)
                new = BeamSearchSequence(
                    beam.tokens + [token], beam.logprobs + [chosen], beam.cum_logprob + logprob
                )
                if token in self.eos_token_ids:
                    new.finish_reason = "stop"
                    self.complete.append(new)
                else:
                    extended.append(new)
        # Extensions of one step are of one length: the likeliest are the best.
        extended.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.live = extended[: self.params.beam_width]
        self.steps += 1

    def score(self, beam: BeamSearchSequence) -> float:
        generated = len(beam.tokens) - self.prompt_len
        return beam.cum_logprob / (generated**self.params.length_penalty)

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The `beam_width` best beams, best first, their text from `decode(token ids)`."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.complete + self.live, key=self.score, reverse=True)
        best = ranked[: self.params.beam_width]
        for beam in best:
            generated = beam.tokens[self.prompt_len :]
            if beam.finish_reason == "stop":
                generated = generated[:-1]
            beam.text = decode(generated)
        return BeamSearchOutput(best)


async def beam_search(
    engine: AsyncLLM,
    prompt: list[int],
    params: BeamSearchParams,
    request_id: str,
    logprobs: int | None = None,
    **options: Any,
) -> AsyncIterator[RequestOutput]:
    """One prompt's search on `engine`, each step's beams run side by side as requests named
    after `request_id` (with `options`: priority, cache salt, ... as `generate` takes them).
    Yields one finished output, its completions the beams, best first; each with its tokens'
    logprobs and top `logprobs` where that is not None."""
    search = BeamSearch(prompt, params, engine.engine.eos_token_ids)

    async def extend(beam: list[int], name: str) -> TokenLogprob:
        step_params = search.step_params
        async for output in engine.generate(
            beam, step_params, request_id=name, final_only=True, **options
        ):
            if output.error is not None or output.outputs[0].finish_reason in ("abort", "error"):
                raise ValueError(f"beam search failed: {output.error or 'a beam was aborted'}")
            last = output
        return last.outputs[0].logprobs[0]

    while not search.done:
        beams = search.prompts()
        names = [f"{request_id}-{search.steps}-{i}" for i in range(len(beams))]
        search.advance(await asyncio.gather(*map(extend, beams, names)))
    tokenizer = engine.tokenizer
    best = search.output(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    yield RequestOutput(
        request_id=request_id,
        prompt_token_ids=prompt,
        outputs=[
            CompletionOutput(
                index=i,
                text=beam.text or "",
                token_ids=beam.tokens[len(prompt) :],
                finish_reason=beam.finish_reason,
                logprobs=None
                if logprobs is None
                else [replace(lp, top=lp.top[:logprobs]) for lp in beam.logprobs],
            )
            for i, beam in enumerate(best.sequences)
        ],
        finished=True,
    )
