"""Pooling: from a step's hidden states to each sequence's vector.

The runner reduces each scheduled chunk to one row (`pool_chunks`); the core folds a request's
chunks together and, once its prompt has run, finishes its vector (`finish_embeddings`): a mean's
sum divided by its length, cut to the dimensions asked for, normalized where asked. An encoder's
sequence is one chunk; a decoder's prompt may run in several.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_chunks(hidden: torch.Tensor, bounds: list[int], pooling_type: str) -> torch.Tensor:
    """`[chunks, hidden]` float32, chunk i being rows `bounds[i]:bounds[i + 1]` of `hidden`: the
    sum of its rows ("mean"), its first row ("cls"), or its last ("last")."""
    if pooling_type == "cls":
        return hidden[bounds[:-1]].float()
    if pooling_type == "last":
        return hidden[[end - 1 for end in bounds[1:]]].float()
    starts = torch.tensor(bounds[:-1], device=hidden.device)
    lengths = torch.tensor(bounds[1:], device=hidden.device) - starts
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, segments, hidden.float())


def finish_embeddings(
    pooled: torch.Tensor,
    lengths: list[int],
    mean: bool,
    dimensions: list[int],
    normalize: list[bool],
) -> list[torch.Tensor]:
    """Each sequence's vector (1-D float32, its own storage) from its pooled row: divided by its
    `lengths` token count for a `mean`, cut to its `dimensions`, L2-normalized where
    `normalize` says."""
    if mean:
        pooled = pooled / torch.tensor(lengths, dtype=pooled.dtype, device=pooled.device)[:, None]
    out: list[torch.Tensor | None] = [None] * len(lengths)
    # Requests asking alike are finished together: usually the whole step at once.
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, key in enumerate(zip(dimensions, normalize, strict=True)):
        groups.setdefault(key, []).append(i)
    for (size, norm), rows in groups.items():
        part = pooled[rows, :size] if len(rows) < len(lengths) else pooled[:, :size]
        if norm:
            part = F.normalize(part, dim=1)
        for i, vector in zip(rows, part.cpu().unbind(0), strict=True):
            out[i] = vector.clone()
    return out
