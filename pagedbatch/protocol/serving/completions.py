"""`/v1/completions`: raw prompts in, a text_completion out.

A request may carry several prompts; each becomes one engine request with `n` completions, and
choice `i * n + j` is completion `j` of prompt `i`, as OpenAI numbers them.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
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
            choices.extend(
                CompletionChoice(
                    index=i * n + choice.index,
                    text=echoed + choice.text,
                    finish_reason=finish_reason(choice, output),
                    logprobs=self._logprobs(choice, len(echoed)),
                    prompt_logprobs=prompt_logprobs(output.prompt_logprobs, self.pieces),
                )
                for choice in output.outputs
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
        """A writer of one choice's logprobs, its text starting at `offset`; None if not asked."""
        if self.request.logprobs is None:
            return None
        return LogprobsWriter(self.pieces, offset)

    def _logprobs(self, choice: CompletionOutput, offset: int) -> CompletionLogprobs | None:
        writer = self.logprobs_writer(offset)
        return None if writer is None else writer.write(choice.logprobs or [])


class LogprobsWriter:
    """One choice's logprobs, written in order, in one piece or as a stream of pieces.

    A character split over tokens is counted at its last byte, so offsets index the text.
    """

    def __init__(self, pieces: TokenPieces, offset: int) -> None:
        self._pieces = pieces
        self._offset = offset
        self._text_so_far = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, token_logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """The logprobs of the choice's next tokens."""
        pieces = self._pieces
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in token_logprobs:
            logprobs.tokens.append(pieces.text(lp.token_id))
            logprobs.token_logprobs.append(lp.logprob)
            logprobs.top_logprobs.append({pieces.text(t): v for t, v in lp.top})
            logprobs.text_offset.append(self._offset)
            if lp.token_id not in pieces.special:
                self._offset += len(self._text_so_far.decode(pieces.bytes(lp.token_id)))
        return logprobs


def prepare_completion(request: CompletionRequest, served: ServedModel) -> PreparedCompletion:
    """The engine requests for `request`, one per prompt; OpenAIError if it cannot be served."""
    check_model(request.model, served)
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
    params = sampling_params(
        request, max_tokens=request.max_tokens, logprobs=request.logprobs, tokenizer=tokenizer
    )
    completion_id = new_id("cmpl-")
    return PreparedCompletion(
        request=request,
        id=completion_id,
        created=now(),
        model=served.model_name,
        tokenizer=tokenizer,
        prompts=prompts,
        inputs=[
            EngineInput(f"{completion_id}-{i}", ids, params) for i, ids in enumerate(token_ids)
        ],
    )


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
    if request.best_of is not None and request.best_of > request.n:
        raise not_supported("best_of greater than n", "best_of")
    if request.echo and request.logprobs is not None:
        raise not_supported("echo with logprobs", "echo")
