"""The Triton RMSNorm kernels against the torch ones (the reference)."""

from __future__ import annotations

import pytest
import torch

from pagedbatch.kernels import norm, triton_norm

HIDDEN = 96  # not a power of two: the row's tail is masked
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Sums in another order: a float32 ulp or two. The interpreter rounds float32 to bfloat16 by
# truncation where GPUs (and torch) round to nearest, so bfloat16 results may differ by an ulp at
# each rounding.
TOLERANCE = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=1e-5),
}


def inputs(
    device: str, dtype: torch.dtype, rows: int = 13
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, HIDDEN, generator=gen) * 3
    residual = torch.randn(rows, HIDDEN, generator=gen)
    weight = torch.randn(HIDDEN, generator=gen)
    return tuple(t.to(dtype).to(device) for t in (x, residual, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_the_torch_kernel(dtype, device):
    x, _, weight = inputs(device, dtype)
    out = triton_norm.rms_norm(x, weight, EPS)
    expected = norm.rms_norm(x, weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_the_torch_kernel(dtype, device):
    x, residual, weight = inputs(device, dtype)
    normed, new_residual = triton_norm.fused_add_rms_norm(x, residual, weight, EPS)
    _, expected_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(new_residual, expected_residual, **TOLERANCE[dtype])
    # The norm of the residual returned (which in bfloat16 may be an ulp off the reference's).
    torch.testing.assert_close(normed, norm.rms_norm(new_residual, weight, EPS), **TOLERANCE[dtype])


def test_float32_weight_on_half_activations_gives_float32_like_torch(device):
    x, _, weight = inputs(device, torch.float16)
    out = triton_norm.rms_norm(x, weight.float(), EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, norm.rms_norm(x, weight.float(), EPS))


def test_leading_dimensions_and_a_single_row(device):
    x, residual, weight = inputs(device, torch.float32, rows=1)
    x3, residual3 = x.view(1, 1, HIDDEN), residual.view(1, 1, HIDDEN)
    normed, new_residual = triton_norm.fused_add_rms_norm(x3, residual3, weight, EPS)
    expected_normed, expected_residual = norm.fused_add_rms_norm(x3, residual3, weight, EPS)
    assert normed.shape == new_residual.shape == (1, 1, HIDDEN)
    torch.testing.assert_close(normed, expected_normed)
    torch.testing.assert_close(new_residual, expected_residual)


def test_inputs_are_left_alone(device):
    x, residual, weight = inputs(device, torch.float32)
    before = x.clone(), residual.clone()
    triton_norm.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
