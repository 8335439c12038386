"""The experts' grouped matmul (the torch path): each token's output is its experts' outputs
weighted by the router, summed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedbatch.kernels import moe


def routed_problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    """x, w13, w2, topk_weights, topk_ids: one expert (3) taken by every token, the others as
    drawn, and the last expert by none."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) / inter**0.5
    ids = torch.stack(
        [torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)]
    )
    ids[:, 0] = torch.where(ids[:, 1:].eq(3).any(dim=1), ids[:, 0], 3)
    weights = torch.rand(tokens, top_k, generator=generator)
    return x, w13, w2, weights, ids


def per_token(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t], strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


def test_each_token_gets_its_experts_weighted_sum():
    problem = routed_problem(tokens=9, experts=6, top_k=2, hidden=16, inter=24)
    torch.testing.assert_close(
        moe.fused_experts(*problem), per_token(*problem), rtol=1e-5, atol=1e-5
    )


def test_no_tokens_give_no_rows():
    x, w13, w2, weights, ids = routed_problem(tokens=3, experts=4, top_k=2, hidden=16, inter=8)
    assert moe.fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)
