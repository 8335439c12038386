"""RMSNorm kernels against transformers' LlamaRMSNorm, and the decoder layer's residual add."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedbatch.kernels.norm import fused_add_rms_norm, rms_norm

HIDDEN = 96
EPS = 1e-5


def hf_norm(dtype: torch.dtype) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(HIDDEN, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1)))
    return norm.to(dtype)


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, HIDDEN, generator=gen) * 3
    residual = torch.randn(13, HIDDEN, generator=gen)
    return x.to(dtype), residual.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_equals_llama_rms_norm_bitwise(dtype):
    norm = hf_norm(dtype)
    x, _ = inputs(dtype)
    out = rms_norm(x, norm.weight.detach(), EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x).detach(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_add_rms_norm_adds_the_residual_then_norms(dtype):
    """transformers' decoder layer: residual = residual + h, then the next norm reads residual."""
    norm = hf_norm(dtype)
    x, residual = inputs(dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, norm.weight.detach(), EPS)
    expected_residual = residual + x
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, norm(expected_residual).detach(), atol=0, rtol=0)


def test_fused_add_rms_norm_leaves_its_inputs_alone():
    x, residual = inputs(torch.float32)
    x_before, residual_before = x.clone(), residual.clone()
    fused_add_rms_norm(x, residual, torch.ones(HIDDEN), EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
