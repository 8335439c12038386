"""RMSNorm and fused residual-add RMSNorm as Triton kernels: the CUDA path beside `norm.py`, with
the same signatures and the same roundings (one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out,
    residual_out,
    x,
    residual,
    weight,
    stride_out,
    stride_residual_out,
    stride_x,
    stride_residual,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual + row * stride_residual + cols, mask=mask, other=0.0)
        # The residual stream is rounded to x's dtype before the norm reads it, as torch's add is.
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(residual_out + row * stride_residual_out + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    variance = tl.sum(h32 * h32, 0) / hidden
    # The reference rounds the normalised row to x's dtype before scaling by the weight.
    normed = (h32 * tl.rsqrt(variance + eps)).to(h.dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, w * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalizes the last dimension in float32, then scales by `weight` in x's dtype."""
    normed, _ = _launch(x, None, weight, eps)
    return normed


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), the sum rounded to x's dtype; one pass over
    memory instead of three."""
    return _launch(x, residual, weight, eps)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (the norm, the row it normalised): x + residual, or x when there is no residual."""
    hidden = x.shape[-1]
    rows = _rows(x)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    residual_rows = rows if residual is None else _rows(residual)
    residual_out = None if residual is None else torch.empty_like(rows)
    block = triton.next_power_of_2(hidden)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            out if residual_out is None else residual_out,
            rows,
            residual_rows,
            weight,
            out.stride(0),
            out.stride(0) if residual_out is None else residual_out.stride(0),
            rows.stride(0),
            residual_rows.stride(0),
            hidden,
            eps,
            ADD_RESIDUAL=residual is not None,
            BLOCK=block,
            # One program holds a whole row: wide rows get more warps, not more registers each.
            num_warps=min(16, max(4, block // 512)),
            # Unfused multiplies round where torch's do.
            enable_fp_fusion=False,
        )
    return out.view(x.shape), x if residual_out is None else residual_out.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, hidden]` with unit-stride rows (a view where x allows it)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
