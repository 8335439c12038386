"""A mixture of experts' expert MLPs as a grouped matmul: the torch path (the CPU path, and the
reference the Triton kernel is tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedbatch.kernels import activation


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x `[tokens, hidden]`, each token's experts `topk_ids` `[tokens, k]` and their weights;
    expert e is gate/up `w13[e]` `[2 * inter, hidden]`, SiLU-and-mul, down `w2[e]`
    `[hidden, inter]`. Returns each token's experts' outputs times their weights, summed
    `[tokens, hidden]`.

    The (token, expert) pairs are sorted by expert; each expert touched runs one matmul over its
    tokens' rows. Each weighted row is rounded to x's dtype and added into its token in expert
    order, as transformers' experts loop adds them."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    order = topk_ids.flatten().argsort(stable=True)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    scales = topk_weights.flatten().index_select(0, order)[:, None]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        hidden = activation.silu_and_mul(F.linear(rows[start:end], w13[expert]))
        out[start:end] = F.linear(hidden, w2[expert]) * scales[start:end]
        start = end
    # index_add_ adds the rows in order: each token's experts' outputs in expert order.
    return torch.zeros_like(x).index_add_(0, tokens, out)
