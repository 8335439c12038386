"""A mixture of experts' expert MLPs as Triton kernels: the CUDA path beside `moe.py`, same
signature.

The (token, expert) pairs are sorted by expert and each expert's run padded to a whole block of
rows, so that every block of rows belongs to one expert: one grouped-matmul launch then covers
every expert touched (gate/up over the tokens' rows, then down over the pairs' activations,
each pair's row scaled by its router weight), with no per-expert launches and no gathered copy
of the tokens. Each token's k rows are then summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbatch.kernels import triton_activation

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _grouped_matmul_kernel(
    a,
    w,
    c,
    pair_ids,
    block_experts,
    scales,
    n,
    k,
    num_pairs,
    a_rows_per_pair,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    SCALE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[pair] = a[pair // a_rows_per_pair] @ w[expert].T (times scales[pair] with SCALE), for
    the BLOCK_M pairs of this program's block, all of one expert; padding pairs are num_pairs."""
    m_block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(block_experts + m_block).to(tl.int64)
    pairs = tl.load(pair_ids + m_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    a_rows = pairs // a_rows_per_pair
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a_tile = tl.load(
            a + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_tile = tl.load(
            w + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        # float32 products in float32 (not TF32): the torch path's precision.
        acc = tl.dot(a_tile, w_tile, acc, input_precision="ieee")
    out = acc.to(c.dtype.element_ty)
    if SCALE:
        # As torch scales: the matmul's output, in its dtype, times the weight in its own.
        scale = tl.load(scales + pairs, mask=valid, other=0.0)
        out = (out * scale[:, None]).to(c.dtype.element_ty)
    tl.store(
        c + pairs[:, None] * stride_c + cols[None, :], out, mask=valid[:, None] & col_ok[None, :]
    )


def _dot_dtype(a: torch.Tensor) -> tl.dtype:
    """Half-precision operands feed the tensor cores; on a CPU tensor (Triton's interpreter,
    which computes bfloat16 dots wrongly) every dot runs in float32."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return tl.float16 if a.dtype == torch.float16 else tl.bfloat16
    return tl.float32


def _blocks(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (index token * k + j) sorted by expert, each expert's run padded with the
    sentinel num_pairs to a multiple of _BLOCK_M; and each block's expert."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + _BLOCK_M - 1) // _BLOCK_M * _BLOCK_M
    sorted_experts = flat.index_select(0, order)
    run_start = torch.cumsum(counts, 0) - counts
    padded_start = torch.cumsum(padded, 0) - padded
    slots = padded_start[sorted_experts] + torch.arange(num_pairs, device=flat.device)
    slots -= run_start[sorted_experts]
    total = int(padded.sum())
    pair_ids = torch.full((total,), num_pairs, dtype=torch.int64, device=flat.device)
    pair_ids[slots] = order
    experts = torch.arange(num_experts, device=flat.device)
    return pair_ids, torch.repeat_interleave(experts, padded // _BLOCK_M)


def _grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    pair_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    a_rows_per_pair: int,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = w.shape[1:]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, _BLOCK_N))
    _grouped_matmul_kernel[grid](
        a,
        w,
        c,
        pair_ids,
        block_experts,
        c if scales is None else scales,
        n,
        k,
        num_pairs,
        a_rows_per_pair,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        c.stride(0),
        SCALE=scales is not None,
        DOT_DTYPE=_dot_dtype(a),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return c


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """As `moe.fused_experts`: each token's experts' outputs times their weights, summed."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pair_ids, block_experts = _blocks(topk_ids, w13.shape[0])
    num_pairs = num_tokens * top_k
    gate_up = _grouped_matmul(x, w13, pair_ids, block_experts, num_pairs, top_k)
    hidden = triton_activation.silu_and_mul(gate_up)
    scales = topk_weights.flatten().contiguous()
    out = _grouped_matmul(hidden, w2, pair_ids, block_experts, num_pairs, 1, scales)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
