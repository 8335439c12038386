"""The gated MLP activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedbatch.kernels.activation import silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_of_the_gate_times_the_up_projection(dtype):
    # d a multiple of 32, as in real models: torch's vectorised silu then covers whole rows, where
    # a row's tail would take its scalar path and could differ from a contiguous gate by an ulp.
    gate = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    up = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.cat([gate, up], dim=-1)
    out = silu_and_mul(x)
    assert out.shape == (5, 3, 64)
    # Bitwise what transformers' LlamaMLP computes: act_fn(gate_proj(x)) * up_proj(x).
    torch.testing.assert_close(out, F.silu(gate) * up, atol=0, rtol=0)
    assert torch.equal(x, torch.cat([gate, up], dim=-1)), "the input is left as it was"
