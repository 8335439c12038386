"""Bidirectional attention over a packed batch of whole sequences (an encoder's step).

Sequence i owns rows `bounds[i]:bounds[i + 1]` of q, k and v (`[tokens, heads, head_dim]`) and
attends to all of its own tokens and to no other sequence's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    """`[tokens, heads, head_dim]`: each sequence's attention output, in its rows."""
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # [heads, len, head_dim] views: SDPA reads them strided.
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            scale=scale,
        ).transpose(0, 1)
    return out
