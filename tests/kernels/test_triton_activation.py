"""The Triton SiLU-and-mul kernel against the torch one (the reference)."""

from __future__ import annotations

import pytest
import torch

from pagedbatch.kernels import activation, triton_activation

# exp differs by an ulp or so between libraries. The interpreter rounds float32 to bfloat16 by
# truncation where GPUs (and torch) round to nearest: a bfloat16 ulp at each rounding.
TOLERANCE = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=1e-5),
}


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("d", [64, 1500], ids=["one_tile", "tiles_and_a_tail"])
def test_matches_the_torch_kernel(d, dtype, device):
    x = torch.randn(5, 2, 2 * d, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    before = x.clone()
    out = triton_activation.silu_and_mul(x)
    assert out.shape == (5, 2, d) and out.dtype == dtype
    torch.testing.assert_close(out, activation.silu_and_mul(x), **TOLERANCE[dtype])
    assert torch.equal(x, before), "the input is left as it was"
