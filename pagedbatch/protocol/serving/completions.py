"""`/v1/completions`: raw prompts in, a text_completion out.

A request may carry several prompts; each becomes one engine request with `n` completions, and
choice `i * n + j` is completion `j` of prompt `i`, as OpenAI numbers them. With `best_of` > `n`
the engine request has `best_of` completions, and the `n` with the highest cumulative logprob
(the sampled tokens', under the model's distribution) are the choices, best first.

`echo` with `logprobs`: a choice's logprobs start with its prompt's tokens (the first with a
null logprob and null top logprobs, as OpenAI's legacy API gave them), scored by the engine as
vLLM's `prompt_logprobs`, then its own tokens', their text offsets running on. Streamed, as
vLLM streams it, a choice's first chunk holds the prompt and its logprobs before its first
tokens'.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.completions import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Prompt,
)
from pagedbatch.protocol.serving.common import (
    EngineInput,
    ServedModel,
    TokenPieces,
    beam_params,
    check_context_length,
    check_model,
    check_vocabulary,
    encode_prompt,
    finish_reason,
    new_id,
    not_supported,
    now,
    sampling_params,
    usage,
)
from pagedbatch.protocol.serving.prompt_logprobs import prompt_logprobs


@dataclass
class PreparedCompletion:
    request: CompletionRequest
    id: str
    created: int
    model: str
    tokenizer: PreTrainedTokenizerBase
    prompts: list[str | list[int]]
    inputs: list[EngineInput]

    def input_texts(self) -> list[str]:
        """Each prompt, as text (a prompt of token ids decoded)."""
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in self.prompts]

    def response(self, outputs: Sequence[RequestOutput]) -> Completion:
        n = self.request.n
        choices = []
        for i, output in enumerate(outputs):
            echoed = self.echoed(i)
            scored = prompt_logprobs(
                output.prompt_logprobs, self.request.prompt_logprobs, self.pieces
            )
            choices.extend(
                CompletionChoice(
                    index=i * n + j,
                    text=echoed + choice.text,
                    finish_reason=finish_reason(choice, output),
                    logprobs=self._logprobs(output, choice, len(echoed)),
                    prompt_logprobs=scored,
                )
                for j, choice in enumerate(self._best(output))
            )
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage(outputs),
        )

    def echoed(self, position: int) -> str:
        """What each choice of the prompt at `position` starts with: the prompt, if echoed."""
        if not self.request.echo:
            return ""
        prompt = self.prompts[position]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    @cached_property
    def pieces(self) -> TokenPieces:
        return TokenPieces(self.tokenizer)

    def logprobs_writer(self, offset: int) -> LogprobsWriter | None:
        """A writer of one choice's logprobs, its text starting at `offset` (0 where the prompt
        is echoed: its logprobs come first); None if not asked."""
        if self.request.logprobs is None:
            return None
        if self.request.echo:
            # The engine may have scored the prompt's positions for more than `logprobs`.
            return LogprobsWriter(self.pieces, 0, self.request.logprobs)
        return LogprobsWriter(self.pieces, offset)

    def _best(self, output: RequestOutput) -> list[CompletionOutput]:
        """The choices of one prompt: its `n` completions, or the `n` best of `best_of`."""
        if len(output.outputs) == self.request.n:
            return output.outputs
        ranked = sorted(
            output.outputs, key=lambda c: sum(lp.logprob for lp in c.logprobs or []), reverse=True
        )
        return ranked[: self.request.n]

    def _logprobs(
        self, output: RequestOutput, choice: CompletionOutput, offset: int
    ) -> CompletionLogprobs | None:
        writer = self.logprobs_writer(offset)
        if writer is None:
            return None
        echoed = self.echoed_logprobs(writer, output.prompt_token_ids, output.prompt_logprobs)
        return writer.write(choice.logprobs or [], into=echoed)

    def echoed_logprobs(
        self,
        writer: LogprobsWriter,
        prompt: Sequence[int],
        scored: Sequence[TokenLogprob | None] | None,
    ) -> CompletionLogprobs | None:
        """The logprobs of the echoed prompt, written first by a choice's `writer`; None where
        the prompt is not echoed."""
        if not self.request.echo:
            return None
        return writer.write_prompt(prompt, scored or [])


class LogprobsWriter:
    """One choice's logprobs, written in order, in one piece or as a stream of pieces.

    A character split over tokens is counted at its last byte, so offsets index the text.
    """

    def __init__(self, pieces: TokenPieces, offset: int, top: int | None = None) -> None:
        self._pieces = pieces
        self._offset = offset
        self._top = top  # the top logprobs shown of each token (None: all the engine gave)
        self._text_so_far = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(
        self, token_logprobs: Sequence[TokenLogprob], into: CompletionLogprobs | None = None
    ) -> CompletionLogprobs:
        """The logprobs of the choice's next tokens (appended to `into`, if given)."""
        logprobs = into if into is not None else _no_logprobs()
        for lp in token_logprobs:
            top = lp.top[: self._top]
            self._append(
                logprobs, lp.token_id, lp.logprob, {self._pieces.text(t): v for t, v in top}
            )
        return logprobs

    def write_prompt(
        self, prompt: Sequence[int], scored: Sequence[TokenLogprob | None]
    ) -> CompletionLogprobs:
        """The logprobs of an echoed prompt: its first token's null, then `scored`'s (the
        engine's prompt_logprobs, None first)."""
        logprobs = _no_logprobs()
        self._append(logprobs, prompt[0], None, None)
        return self.write([lp for lp in scored if lp is not None], into=logprobs)

    def _append(
        self,
        logprobs: CompletionLogprobs,
        token: int,
        logprob: float | None,
        top: dict[str, float] | None,
    ) -> None:
        pieces = self._pieces
        logprobs.tokens.append(pieces.text(token))
        logprobs.token_logprobs.append(logprob)
        logprobs.top_logprobs.append(top)
        logprobs.text_offset.append(self._offset)
        if token not in pieces.special:
            self._offset += len(self._text_so_far.decode(pieces.bytes(token)))


def _no_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])


def prepare_completion(request: CompletionRequest, served: ServedModel) -> PreparedCompletion:
    """The engine requests for `request`, one per prompt; OpenAIError if it cannot be served."""
    lora_name = check_model(request.model, served)
    _refuse_unsupported(request)
    tokenizer = served.tokenizer
    prompts = _split_prompts(request.prompt)
    token_ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        # Each of a list of prompts is named as the schema's checks name it.
        param = "prompt" if prompt is request.prompt else f"prompt[{i}]"
        ids = (
            encode_prompt(prompt, request.max_tokens, served, param=param, add_special_tokens=True)
            if isinstance(prompt, str)
            else prompt
        )
        if not ids:  # "" with a tokenizer that adds no BOS: nothing for the model to go on
            raise OpenAIError(
                f"Invalid value for '{param}': the prompt is empty (it has no tokens).",
                param=param,
                code="invalid_value",
            )
        check_vocabulary(ids, len(tokenizer), param=param)
        check_context_length(len(ids), request.max_tokens, served, param=param)
        token_ids.append(ids)
    params = _engine_params(request, tokenizer)
    beam = beam_params(request, request.max_tokens, 0, served)
    completion_id = new_id("cmpl-")
    return PreparedCompletion(
        request=request,
        id=completion_id,
        created=now(),
        model=served.model_name,
        tokenizer=tokenizer,
        prompts=prompts,
        inputs=[
            EngineInput(
                f"{completion_id}-{i}",
                ids,
                params,
                user_priority=request.priority,
                lora_name=lora_name,
                beam=beam,
            )
            for i, ids in enumerate(token_ids)
        ],
    )


def _engine_params(
    request: CompletionRequest, tokenizer: PreTrainedTokenizerBase
) -> SamplingParams:
    """The request's SamplingParams: `best_of` completions, each with its sampled tokens'
    logprobs where the best are chosen by them; the prompt scored for echo's logprobs too."""
    best_of = request.best_of or request.n
    logprobs = request.logprobs
    if best_of > request.n and logprobs is None:
        logprobs = 0
    params = sampling_params(
        request, max_tokens=request.max_tokens, logprobs=logprobs, tokenizer=tokenizer
    )
    scored = params.prompt_logprobs
    if request.echo and request.logprobs is not None:
        scored = max(scored or 0, request.logprobs)
    return replace(params, n=best_of, prompt_logprobs=scored)


def _split_prompts(prompt: Prompt) -> list[str | list[int]]:
    """The prompts of a request: one string, one token list, or a list of either."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _refuse_unsupported(request: CompletionRequest) -> None:
    if request.suffix is not None:
        raise not_supported("suffix", "suffix")
    if request.best_of is not None and request.best_of < request.n:
        raise OpenAIError(
            f"best_of ({request.best_of}) must be at least n ({request.n}).", param="best_of"
        )
    if request.best_of is not None and request.best_of > request.n and request.stream:
        # As OpenAI: the best are known only once all have finished.
        raise OpenAIError("best_of greater than n cannot be streamed.", param="best_of")
    if request.use_beam_search and (request.best_of or request.n) > request.n:
        raise not_supported("best_of with beam search", "best_of")
    if request.use_beam_search and request.echo and request.logprobs is not None:
        raise not_supported("echo with logprobs with beam search", "echo")
