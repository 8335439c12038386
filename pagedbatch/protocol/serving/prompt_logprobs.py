"""vLLM's `prompt_logprobs` in its response shape: for each prompt position, None for the first,
then a dict from token id to {logprob, rank, decoded_token} holding the prompt's token and the
top k there."""

from __future__ import annotations

from collections.abc import Sequence

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.protocol.schemas.common import PromptLogprob, PromptLogprobs
from pagedbatch.protocol.serving.common import TokenPieces


def prompt_logprobs(
    scored: Sequence[TokenLogprob | None] | None, pieces: TokenPieces
) -> PromptLogprobs | None:
    """An engine output's `prompt_logprobs` in vLLM's shape; None where none were asked for."""
    if scored is None:
        return None
    return [None if entry is None else _position(entry, pieces) for entry in scored]


def _position(entry: TokenLogprob, pieces: TokenPieces) -> dict[int, PromptLogprob]:
    # The prompt's token first; where it is among the top k, its entry says so once.
    position = {
        entry.token_id: PromptLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=pieces.text(entry.token_id)
        )
    }
    for rank, (token, logprob) in enumerate(entry.top, start=1):
        position.setdefault(
            token, PromptLogprob(logprob=logprob, rank=rank, decoded_token=pieces.text(token))
        )
    return position
