"""Neox-style rotary embedding as a Triton kernel: the CUDA path beside `rotary.py`, with the same
signature and the same cos/sin table (so every rope_scaling variant works unchanged: the table, or
the per-token table that dynamic NTK builds, carries the variant)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x,
    out,
    stride_xh,
    stride_oh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    x1 = tl.load(x + heads * stride_xh + cols, mask=mask, other=0.0)
    x2 = tl.load(x + heads * stride_xh + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # Each product is rounded to x's dtype before the sum, as the reference's torch ops round.
    o1 = (a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)
    o2 = (a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)
    tl.store(out + heads * stride_oh + cols, o1, mask=mask)
    tl.store(out + heads * stride_oh + HALF + cols, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    query_out,
    key_out,
    positions,
    query,
    key,
    cos_sin_cache,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions + token)
    cols = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_cache + position * stride_cache
    dtype = query.dtype.element_ty
    # The reference casts cos and sin to the query's dtype before using them.
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate(
        query + token * stride_qt,
        query_out + token * stride_qot,
        stride_qh,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        HEADS_PAD,
        HALF_PAD,
    )
    _rotate(
        key + token * stride_kt,
        key_out + token * stride_kot,
        stride_kh,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        KV_HEADS_PAD,
        HALF_PAD,
    )


def apply_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query `[T, num_heads, D]` and key `[T, num_kv_heads, D]`; token t uses row
    positions[t] of cos_sin_cache `[rows, D]`, which holds the D/2 cosines then the D/2 sines.
    Returns new tensors; the inputs may be strided views of a fused QKV projection."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    for t in (query, key, cos_sin_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"expected a unit stride in the last dimension, got {t.stride()}")
    _rotary_kernel[(num_tokens,)](
        query_out,
        key_out,
        positions,
        query,
        key,
        cos_sin_cache,
        query_out.stride(0),
        query_out.stride(1),
        key_out.stride(0),
        key_out.stride(1),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        # Without fused multiply-adds, float32 results equal the reference's bit for bit.
        enable_fp_fusion=False,
    )
    return query_out, key_out
