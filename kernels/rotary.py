"""Rotary position embedding, neox style (rotate_half), as Llama, Qwen2 and Mistral use it.

On the CPU, float32 queries and keys go to the C kernel (`cpu_rotary.c`, see `native`): one pass
over both, where torch makes a dozen small ones a layer. Other dtypes and devices take torch."""

from __future__ import annotations

import ctypes

import torch

from pagedbatch.kernels import native


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
    lib = native.library() if _fits_c_kernel(positions, query, key, cos_sin_cache) else None
    if lib is not None:
        return _rotate_in_c(lib, positions, query, key, cos_sin_cache)
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


def _fits_c_kernel(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor
) -> bool:
    """Float32 on the CPU, each token's heads contiguous (views of a fused QKV projection are),
    and shapes that agree: the kernel trusts them, where torch would refuse what does not fit."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (query, key, cos_sin))
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (query, key))
        and positions.numel() == query.shape[0] == key.shape[0]
        and cos_sin.dim() == 2
        and cos_sin.shape[1] == query.shape[2] == key.shape[2]
    )


def _rotate_in_c(
    lib: ctypes.CDLL,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = positions.to(torch.int64).contiguous()
    cos_sin = cos_sin.contiguous()
    q_out, k_out = torch.empty(query.shape), torch.empty(key.shape)
    status = lib.rotary_embedding(
        positions.data_ptr(), positions.numel(),
        query.data_ptr(), query.stride(0), query.shape[1],
        key.data_ptr(), key.stride(0), key.shape[1],
        query.shape[2], cos_sin.data_ptr(), cos_sin.shape[0], torch.get_num_threads(),
        q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"a position is past the rotary table's {cos_sin.shape[0]} rows")
    return q_out, k_out
