"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob under the model, given
the tokens before it, with its rank and the `k` likeliest tokens at its position.

A request that asks has the logits of every prompt position computed, chunk by chunk as its
prefill runs (position p's logits score token p + 1; the last position's are sampled, as any
request's). It reads nothing from the prefix cache (cached positions' logits are not kept), and
positions already scored before a preemption are not scored again when its prompt is recomputed.

The cost is bounded: k by `MAX_LOGPROBS`, and the logits of at most `SLICE_ROWS` positions are
held at once (a row is the vocabulary's width, float32), each slice reduced to what is kept (the
token's logprob and rank, and the top k) before the next is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedbatch.engine.core.request import TokenLogprob

if TYPE_CHECKING:
    from pagedbatch.engine.core.scheduler import ScheduledRequest

# Positions whose logits are held at once: 256 rows of a 152K vocabulary are 156 MB of float32.
SLICE_ROWS = 256


def scored_positions(s: ScheduledRequest) -> range:
    """The positions of `s`'s chunk whose logits score a prompt token not yet scored."""
    request = s.request
    if not request.scores_prompt:
        return range(0)
    # Position p scores token p + 1; tokens 1 .. len(prompt_logprobs) are scored already.
    first = max(s.start, len(request.prompt_logprobs))
    return range(first, min(s.end, request.num_prompt_tokens - 1))


@dataclass
class PromptRows:
    """A step's rows whose logits score prompt tokens: the row, the token it scores, and the
    most top tokens any of their requests asks for."""

    rows: list[int]
    targets: list[int]
    top: int


@dataclass
class ScoredRows:
    """What `PromptRows` came to, row by row (CPU tensors)."""

    logprobs: torch.Tensor  # [rows] float32: the target token's logprob
    ranks: torch.Tensor  # [rows] int64: 1 = the likeliest token
    top_ids: torch.Tensor  # [rows, top] int64, likeliest first
    top_logprobs: torch.Tensor  # [rows, top] float32


def score_rows(
    hidden: torch.Tensor, rows: PromptRows, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> ScoredRows:
    """`rows` of the step's final hidden states scored, SLICE_ROWS at a time."""
    device = hidden.device
    index = torch.tensor(rows.rows, dtype=torch.long, device=device)
    targets = torch.tensor(rows.targets, dtype=torch.long, device=device)
    parts: list[tuple[torch.Tensor, ...]] = []
    for first in range(0, len(rows.rows), SLICE_ROWS):
        here = slice(first, first + SLICE_ROWS)
        logprobs = torch.log_softmax(compute_logits(hidden[index[here]]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[here, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(rows.top, dim=-1)
        parts.append((chosen[:, 0], ranks, top_ids, top_logprobs))
    columns = [torch.cat(column).cpu() for column in zip(*parts, strict=True)]
    return ScoredRows(*columns)


def prompt_rows(scheduled: Sequence[ScheduledRequest], first_rows: Sequence[int]) -> PromptRows:
    """The rows of a step (each chunk starting at its `first_rows` entry) that score prompts."""
    rows: list[int] = []
    targets: list[int] = []
    top = 0
    for s, first_row in zip(scheduled, first_rows, strict=True):
        positions = scored_positions(s)
        if not positions:
            continue
        tokens = s.request.prompt_token_ids
        rows.extend(first_row + p - s.start for p in positions)
        targets.extend(tokens[p + 1] for p in positions)
        top = max(top, s.request.sampling_params.prompt_logprobs or 0)
    return PromptRows(rows, targets, top)


def record(scheduled: Sequence[ScheduledRequest], scored: ScoredRows) -> None:
    """Each request's share of `scored` (rows in the order `prompt_rows` gave them) appended to
    its `prompt_logprobs`."""
    values = scored.logprobs.tolist()
    ranks = scored.ranks.tolist()
    top_ids = scored.top_ids.tolist()
    top_values = scored.top_logprobs.tolist()
    row = 0
    for s in scheduled:
        positions = scored_positions(s)
        if not positions:
            continue
        request = s.request
        k = request.sampling_params.prompt_logprobs or 0
        tokens = request.prompt_token_ids
        for p in positions:
            top = list(zip(top_ids[row][:k], top_values[row][:k], strict=True))
            scored = TokenLogprob(tokens[p + 1], values[row], ranks[row], top)
            request.prompt_logprobs.append(scored)
            row += 1
