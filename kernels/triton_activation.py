"""SiLU-and-mul as a Triton kernel: the CUDA path beside `activation.py`, same signature."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out, x, stride_out, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch rounds silu's output to x's dtype before the product.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out + row * stride_out + cols, silu.to(tl.float32) * up.to(tl.float32), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is `[..., 2 * d]`, the gate projection then the up projection; returns silu(gate) * up."""
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), _MAX_BLOCK)
        grid = (rows.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](
            out,
            rows,
            out.stride(0),
            rows.stride(0),
            d,
            BLOCK=block,
            # Unfused multiplies round where torch's do.
            enable_fp_fusion=False,
        )
    return out.view(*x.shape[:-1], d)
