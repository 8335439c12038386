"""The Triton experts' grouped matmul against the torch one (the reference)."""

from __future__ import annotations

import pytest
import torch
from test_fused_experts import routed_problem

from pagedbatch.kernels import moe, triton_moe

# float32 in IEEE precision sums in another order than MKL's; bfloat16 rounds each expert's
# output (and the interpreter truncates where GPUs round to nearest).
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-5, atol=2**-5),
}


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [(9, 6, 2, 64, 48), (40, 8, 3, 96, 80)],
    ids=["few_tokens", "blocks_and_tails"],
)
def test_matches_the_torch_kernel(tokens, experts, top_k, hidden, inter, dtype, device):
    problem = routed_problem(tokens, experts, top_k, hidden, inter)
    x, w13, w2, weights, ids = (t.to(device) for t in problem)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    out = triton_moe.fused_experts(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    expected = moe.fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
