"""vLLM's `prompt_logprobs` in its response shape: for each prompt position, None for the first,
then a dict from token id to {logprob, rank, decoded_token} holding the prompt's token and the
top k there."""

from __future__ import annotations

from collections.abc import Sequence

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.protocol.schemas.common import PromptLogprob, PromptLogprobs
from pagedbatch.protocol.serving.common import TokenPieces


def prompt_logprobs(
    scored: Sequence[TokenLogprob | None] | None, k: int | None, pieces: TokenPieces
) -> PromptLogprobs | None:
    """An engine output's `prompt_logprobs` in vLLM's shape, each position's top `k` (the
    engine may have scored more, for echo's logprobs); None where `k` is (none were asked for)."""
    if scored is None or k is None:
        return None
    return [None if entry is None else _position(entry, k, pieces) for entry in scored]


def _position(entry: TokenLogprob, k: int, pieces: TokenPieces) -> dict[int, PromptLogprob]:
    # The prompt's token first; where it is among the top k, its entry says so once.
    position = {
        entry.token_id: PromptLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=pieces.text(entry.token_id)
        )
    }
    for rank, (token, logprob) in enumerate(entry.top[:k], start=1):
        position.setdefault(
            token, PromptLogprob(logprob=logprob, rank=rank, decoded_token=pieces.text(token))
        )
    return position
