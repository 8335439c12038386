"""Beam search, as vLLM v1 runs it: an orchestration over the engine, not a mode of it; its
beams and their scores are transformers' `num_beams` generate's (default `early_stopping`).

Each step runs every live beam as a request of one token (greedy, its top logprobs) and extends
each beam by those candidates. As transformers, the step keeps the likeliest
`max(2, 1 + end tokens) * beam_width` extensions of all beams (by cumulative logprob): of those,
one that ends (on an end token, or at `max_tokens`) is a finished hypothesis if it is among the
first `beam_width`, scored by cumulative logprob over its length (the end token counted) to the
power `length_penalty`, and kept if it is among the `beam_width` best finished so far; the
`beam_width` likeliest that do not end live on. Once `beam_width` hypotheses have finished, the
search ends as soon as the best live beam, scored at its present length, is no better than the
worst of them. The beams' requests share their prompt (and the tokens the beams share) through
the prefix cache, so a step costs about a block's prefill per beam.
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
        self.complete: list[BeamSearchSequence] = []  # the best finished, best first
        self.steps = 0
        # transformers' count of a step's candidates: enough that `beam_width` go on even where
        # every beam's likeliest extensions are end tokens.
        self.candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self._improvable = True  # whether a live beam may still beat a finished one

    @property
    def step_params(self) -> SamplingParams:
        """What each beam's request of a step runs with: its top logprobs, as many as a step
        keeps (all of them might extend one beam), within the engine's bound."""
        width = min(self.candidates, MAX_LOGPROBS)
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=width, ignore_eos=True)

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not self.live or not self._improvable

    def prompts(self) -> list[list[int]]:
        return [beam.tokens for beam in self.live]

    def advance(self, tops: Sequence[TokenLogprob]) -> None:
        """Extend each live beam by the candidates of its step's `TokenLogprob`."""
        width = self.params.beam_width
        last = self.steps + 1 >= self.params.max_tokens  # every extension ends here
        extensions = [
            (beam, TokenLogprob(token, logprob, rank, step.top))
            for beam, step in zip(self.live, tops, strict=True)
            for rank, (token, logprob) in enumerate(step.top, start=1)
        ]
        # Stable: equal scores keep the beams' order, then the tokens' rank.
        extensions.sort(key=lambda e: e[0].cum_logprob + e[1].logprob, reverse=True)
        live: list[BeamSearchSequence] = []
        for i, (beam, chosen) in enumerate(extensions[: self.candidates]):
            new = BeamSearchSequence(
                beam.tokens + [chosen.token_id],
                beam.logprobs + [chosen],
                beam.cum_logprob + chosen.logprob,
            )
            ends = chosen.token_id in self.eos_token_ids
            if not (ends or last):
                if len(live) < width:
                    live.append(new)
            elif i < width:  # the rest are only there to keep `width` beams going
                new.finish_reason = "stop" if ends else "length"
                self.complete.append(new)
        self.complete.sort(key=self.score, reverse=True)
        del self.complete[width:]
        self.live = live
        self.steps += 1
        if len(self.complete) == width and live:
            # transformers' early stop heuristic (`early_stopping=False`): the best live beam as
            # if it ended now.
            best = live[0].cum_logprob / self.steps**self.params.length_penalty
            self._improvable = best > self.score(self.complete[-1])

    def score(self, beam: BeamSearchSequence) -> float:
        generated = len(beam.tokens) - self.prompt_len
        return beam.cum_logprob / (generated**self.params.length_penalty)

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The `beam_width` best finished beams, best first, their text from `decode(token
        ids)`; the beams still live when the search stopped early are not among them, as in
        transformers."""
        best = self.complete
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
