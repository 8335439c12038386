"""RMSNorm, computed exactly as transformers' LlamaRMSNorm so float32 results are bitwise equal."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalizes the last dimension in float32, then scales by `weight` in x's dtype."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the decoder layer's residual add, done in
    x's dtype as transformers does, then the next norm."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
