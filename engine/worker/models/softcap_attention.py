"""Paged attention with soft-capped scores (Gemma 2's `attn_logit_softcapping`): each score
becomes cap * tanh(score / cap) before the mask and the softmax, as transformers' eager attention
computes it. SDPA, the C decode kernel and the Triton kernel have no such step, so this is torch
on gathered keys (a quantized cache's dequantized as they are gathered, kv_quant.gather), on any
device: decode sequences (one query each) batched, padded to the
longest context of their chunk; a sequence with more queries alone, its queries in chunks."""

from __future__ import annotations

import torch

from pagedbatch.kernels.attention import AttentionMetadata
from pagedbatch.kernels.kv_quant import KVCacheTensor, gather

# Gathered key elements per decode chunk (values as many again): float32, 16 MiB each.
_DECODE_ELEMENTS = 4 * 2**20
# Query rows scored at once: a long prefill's scores take heads x rows x context floats.
_QUERY_ROWS = 512


def softcapped_paged_attention(
    query: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """As `kernels.attention.paged_attention` (query `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context, causal, a sliding window w keeping keys k with p - k < w), the
    scaled scores soft-capped at `softcap`."""
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    decodes.sort(key=lambda i: -seq_lens[i])
    row_elements = key_cache.shape[2] * key_cache.shape[3]
    while decodes:
        count = max(1, _DECODE_ELEMENTS // (seq_lens[decodes[0]] * row_elements))
        chunk, decodes = decodes[:count], decodes[count:]
        _decode(query, key_cache, value_cache, meta, chunk, scale, softcap, sliding_window, out)
    for i, seq_len in enumerate(seq_lens):
        if starts[i + 1] - starts[i] > 1:
            _prefill(query, key_cache, value_cache, meta, i, starts[i], starts[i + 1], seq_len,
                     scale, softcap, sliding_window, out)  # fmt: skip
    return out


def _decode(
    query: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
    softcap: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequences `seqs`, one query each, in one batched call."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    device = query.device
    index = torch.tensor(seqs, device=device)
    seq_lens = meta.seq_lens.index_select(0, index)
    rows = meta.query_start_loc.index_select(0, index)
    key_pos = torch.arange(int(seq_lens.max()), device=device)
    # Padding positions read the sequence's last key (a block it holds), masked below.
    read = torch.minimum(key_pos[None, :], seq_lens[:, None] - 1)
    blocks = meta.block_tables.index_select(0, index).gather(1, read // meta.block_size).long()
    slots = blocks * meta.block_size + read % meta.block_size
    k = gather(key_cache, slots, query.dtype)  # [seqs, keys, kv_heads, head_dim]
    v = gather(value_cache, slots, query.dtype)
    q = query.index_select(0, rows).view(len(seqs), num_kv_heads, -1, head_dim)
    masked = key_pos[None, :] >= seq_lens[:, None]
    if sliding_window is not None:
        masked |= seq_lens[:, None] - 1 - key_pos[None, :] >= sliding_window
    scores = torch.einsum("skgd,slkd->skgl", q, k) * scale
    probs = _capped_probs(scores, softcap, masked[:, None, None, :], query.dtype)
    attended = torch.einsum("skgl,slkd->skgd", probs, v).reshape(len(seqs), num_heads, head_dim)
    out.index_copy_(0, rows, attended)


def _prefill(
    query: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    meta: AttentionMetadata,
    seq: int,
    start: int,
    end: int,
    seq_len: int,
    scale: float,
    softcap: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequence `seq`'s queries, rows start:end of the batch, the last of its seq_len positions."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    groups = num_heads // num_kv_heads
    key_pos = torch.arange(seq_len, device=query.device)
    blocks = meta.block_tables[seq].long()[key_pos // meta.block_size]
    slots = blocks * meta.block_size + key_pos % meta.block_size
    # [heads, keys, head_dim], each query head beside its KV head's keys
    k = gather(key_cache, slots, query.dtype).transpose(0, 1)
    v = gather(value_cache, slots, query.dtype).transpose(0, 1)
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    first_pos = seq_len - (end - start)
    for row in range(start, end, _QUERY_ROWS):
        stop = min(row + _QUERY_ROWS, end)
        q = query[row:stop].transpose(0, 1)  # [heads, rows, head_dim]
        query_pos = key_pos[first_pos + row - start : first_pos + stop - start, None]
        masked = key_pos[None, :] > query_pos
        if sliding_window is not None:
            masked |= query_pos - key_pos[None, :] >= sliding_window
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        probs = _capped_probs(scores, softcap, masked, query.dtype)
        out[row:stop] = torch.matmul(probs, v).transpose(0, 1)


def _capped_probs(
    scores: torch.Tensor, softcap: float, masked: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Scaled scores soft-capped (cap * tanh(x / cap)), the `masked` keys left out, then the
    softmax in float32 rounded to `dtype`, as transformers computes them."""
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(masked, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
