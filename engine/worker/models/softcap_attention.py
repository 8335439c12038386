"""Paged attention with soft-capped scores (Gemma 2's `attn_logit_softcapping`): each score
becomes cap * tanh(score / cap) before the mask and the softmax, as transformers' eager attention
computes it. SDPA, the C decode kernel and the Triton kernel have no such step, so this is torch
on each sequence's gathered keys: the reference's speed, on any device."""

from __future__ import annotations

import torch

from pagedbatch.kernels.attention import AttentionMetadata

# Query rows scored at once: a long prefill's scores take heads x rows x context floats.
_QUERY_ROWS = 512


def softcapped_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """As `kernels.attention.paged_attention` (query `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context, causal, a sliding window w keeping keys k with p - k < w), the
    scaled scores soft-capped at `softcap`."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    groups = num_heads // num_kv_heads
    keys = key_cache.view(-1, num_kv_heads, head_dim)
    values = value_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if start == end:
            continue
        key_pos = torch.arange(seq_len, device=query.device)
        blocks = meta.block_tables[i].long()[key_pos // meta.block_size]
        slots = blocks * meta.block_size + key_pos % meta.block_size
        # [heads, keys, head_dim], each query head beside its KV head's keys
        k = keys.index_select(0, slots).transpose(0, 1).repeat_interleave(groups, dim=0)
        v = values.index_select(0, slots).transpose(0, 1).repeat_interleave(groups, dim=0)
        first_pos = seq_len - (end - start)
        for row in range(start, end, _QUERY_ROWS):
            stop = min(row + _QUERY_ROWS, end)
            q = query[row:stop].transpose(0, 1)  # [heads, rows, head_dim]
            scores = torch.matmul(q, k.transpose(1, 2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            query_pos = torch.arange(first_pos + row - start, first_pos + stop - start,
                                     device=query.device)[:, None]  # fmt: skip
            masked = key_pos[None, :] > query_pos
            if sliding_window is not None:
                masked |= query_pos - key_pos[None, :] >= sliding_window
            scores.masked_fill_(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[row:stop] = torch.matmul(probs, v).transpose(0, 1)
    return out
