"""Bidirectional attention over a packed batch of whole sequences (an encoder's step).

The step's sequences lie one after another, those of equal length together (the runner sorts
them by length): group `(row, count, length)` is `count` sequences of `length` tokens from row
`row` on. A group is one batched attention of `[count, heads, length, head_dim]`, with neither
padding nor mask: each sequence attends to all of its own tokens and to no other's. Embedding
requests are short, so a step holds many sequences but few distinct lengths.
"""

from __future__ import annotations

import torch

# A step's sequences of equal length: (first row, how many, their length).
Group = tuple[int, int, int]


def length_groups(lengths: list[int]) -> list[Group]:
    """The groups of sequences of these lengths laid out in this order, equal neighbours
    together."""
    groups: list[Group] = []
    row = 0
    for length in lengths:
        if groups and groups[-1][2] == length:
            first, count, _ = groups[-1]
            groups[-1] = (first, count + 1, length)
        else:
            groups.append((row, 1, length))
        row += length
    return groups


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[Group], scale: float
) -> torch.Tensor:
    """`[tokens, heads, head_dim]` in, the attention output of each sequence in its rows out."""
    num_tokens, heads, head_dim = q.shape
    out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    for row, count, length in groups:
        end = row + count * length
        # [count, heads, length, head_dim] views of the rows; matmul reads them strided.
        qs, ks, vs = (
            t[row:end].view(count, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)
        )
        # Short sequences: two batched matmuls beat the fused kernel's per-call set-up.
        weights = torch.matmul(qs, ks.transpose(2, 3)).mul_(scale).softmax(-1)
        out[row:end].view(count, length, heads, head_dim).copy_(
            torch.matmul(weights, vs).transpose(1, 2)
        )
    return out
