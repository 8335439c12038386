"""Rotary position embedding, neox style (rotate_half), as Llama, Qwen2 and Mistral use it."""

from __future__ import annotations

import torch


def apply_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query `[T, num_heads, D]` and key `[T, num_kv_heads, D]`; token t uses row
    positions[t] of cos_sin_cache `[rows, D]`, which holds the D/2 cosines then the D/2 sines (each
    already multiplied by the RoPE type's attention scaling). Returns new tensors.

    Matches transformers' `q * cos + rotate_half(q) * sin` bitwise: its cos and sin repeat the same
    D/2 values twice, and x1 * c + (-x2) * s equals x1 * c - x2 * s exactly."""
    cos, sin = cos_sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(1).chunk(2, -1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out
