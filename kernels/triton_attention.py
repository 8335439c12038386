"""Paged attention and the KV cache write as Triton kernels: the CUDA path beside the torch
reference in `attention.py`, with the same signatures and the same `AttentionMetadata`.

One kernel serves decode, prefill and chunked prefill. A program takes up to `BLOCK_Q` consecutive
query tokens of one sequence and every query head that shares one KV head, stacked as the rows of
one `[BLOCK_M, head_dim]` tile, so each key and value it loads serves the whole GQA group. It walks
the sequence's keys through the block table in tiles of `BLOCK_N` positions (any block size works:
each key looks up its own block), skipping keys that the causal mask or the sliding window rules
out for all of its rows, and keeps a float32 online softmax.

Which program serves which sequence is found in the kernel, not on the host: sequence i's programs
are numbered from `query_start_loc[i] // BLOCK_Q + i`, a strictly increasing sequence, so a binary
search over `query_start_loc` finds a program's sequence. The grid `num_tokens // BLOCK_Q +
num_seqs` covers every sequence's query blocks; programs past a sequence's last token exit at once.
The launch thus needs nothing from the device, and costs no synchronisation.

A quantized cache (kv_quant.py: int8 or float8 e4m3 elements, a float32 scale per group of
kv_quant.group_size(head_dim) elements of a slot's KV head) is read as bytes and widened to floats
in the kernel (e4m3 by its bits, so that neither the GPU's float8 support nor the interpreter's
matters), and each element multiplied by its group's scale before the tile enters its dot (in
the dot's dtype: half-precision queries' products then see the dequantized elements rounded to
bfloat16 or float16, as a cache of that dtype would hold them). The cache write quantizes through
torch (kv_quant.write): a few elementwise kernels per layer, not fused yet.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedbatch.kernels import attention, kv_quant
from pagedbatch.kernels.attention import AttentionMetadata
from pagedbatch.kernels.kv_quant import KVCacheTensor, QuantizedCache

_LOG2_E = math.log2(math.e)
# The kernel's KV_FORMAT: how a cache's elements are stored.
_AS_IS, _INT8, _FP8 = 0, 1, 2


@triton.jit
def _widen(raw, KV_FORMAT: tl.constexpr):
    """Stored cache elements as float32 (unscaled): float8 e4m3 from its bits (loaded as uint8),
    (8 + m) * 2^(e - 10), or m * 2^-9 where e = 0, as cpu_attention.c's fp8_to_float."""
    if KV_FORMAT == 2:
        x = raw.to(tl.int32)
        e = (x >> 3) & 15
        mantissa = tl.where(e != 0, (x & 7) | 8, x & 7).to(tl.float32)
        power = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)
        magnitude = mantissa * power
        return tl.where((x & 0x80) != 0, -magnitude, magnitude)
    return raw.to(tl.float32)


@triton.jit
def _find_sequence(query_start_loc, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first program, query_start_loc[i] // BLOCK_Q + i, is <= program."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_program = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first_program <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out,
    query,
    key_cache,
    value_cache,
    key_scales,
    value_scales,
    block_tables,
    query_start_loc,
    seq_lens,
    scale_log2,
    num_seqs,
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc, program, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_block = program - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len  # keys cached before this step's tokens

    # Row r is query token q_block * BLOCK_Q + r // GROUP of the sequence, under query head
    # kv_head * GROUP + r % GROUP. Rows past BLOCK_Q * GROUP pad BLOCK_M to a power of two.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + q_idx) * stride_qt + head * stride_qh
    q = tl.load(
        query + q_rows[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # Keys [key_start, key_end) cover every row: the last row's causal limit, the first row's
    # window.
    last_q_idx = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    key_end = context_len + last_q_idx + 1
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(key_start, key_end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < key_end
        # Masked loads keep unwritten slots (whatever they hold, NaN included) and the block
        # table's padding out of the arithmetic.
        block = tl.load(block_tables + seq * stride_bt + k_pos // block_size, mask=k_ok, other=0)
        block = block.to(tl.int64)
        offset = k_pos % block_size
        k_rows = block * stride_kb + offset * stride_ks + kv_head * stride_kh
        k = tl.load(
            key_cache + k_rows[None, :] + dims[:, None],
            mask=k_ok[None, :] & dim_ok[:, None],
            other=0,
        )
        k = _widen(k, KV_FORMAT)
        if KV_FORMAT != 0:  # each element times its group's scale
            s_rows = block * stride_sb + offset * stride_ss + kv_head * stride_sh
            s_cols = dims // SCALE_GROUP
            k_scales = tl.load(
                key_scales + s_rows[None, :] + s_cols[:, None],
                mask=k_ok[None, :] & dim_ok[:, None],
                other=0.0,
            )
            k = k * k_scales
        scores = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee") * scale_log2

        attended = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            attended = attended & (q_pos[:, None] - k_pos[None, :] < window)
        scores = tl.where(attended, scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row with nothing attended so far keeps m = -inf; shifting by 0 instead keeps its
        # exponentials at exactly 0 rather than NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(m - shift)
        denominator = denominator * alpha + tl.sum(p, 1)

        v_rows = block * stride_vb + offset * stride_vs + kv_head * stride_vh
        v = tl.load(
            value_cache + v_rows[:, None] + dims[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0,
        )
        v = _widen(v, KV_FORMAT)
        if KV_FORMAT != 0:  # each element times its group's scale
            v_scales = tl.load(
                value_scales + s_rows[:, None] + s_cols[None, :],
                mask=k_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            v = v * v_scales
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision="ieee")
        m = m_new

    # Every real row attends at least its own key, so its denominator is positive.
    result = acc / tl.where(row_ok, denominator, 1.0)[:, None]
    o_rows = (q_start + q_idx) * stride_ot + head * stride_oh
    tl.store(
        out + o_rows[:, None] + dims[None, :],
        result,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _reshape_and_cache_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_slot = block * stride_kcb + offset * stride_kcs
    v_slot = block * stride_vcb + offset * stride_vcs
    tl.store(key_cache + k_slot + heads * stride_kch + dims, k, mask=mask)
    tl.store(value_cache + v_slot + heads * stride_vch + dims, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value `[num_tokens, num_kv_heads, head_dim]` into their slots of the cache
    (a quantized cache's through torch, see the module's docstring)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if isinstance(key_cache, QuantizedCache):
        attention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    # Rounded by torch where the cache's dtype is narrower: Triton's interpreter truncates to
    # bfloat16 where torch and the GPU round to nearest even.
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    _check_rows(key, value, key_cache, value_cache)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False,  # nothing to fuse; named so that Triton does not warn
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query `[num_tokens, num_heads, head_dim]` over each sequence's cached
    context; returns the same shape. A query at position p attends keys k <= p, and with a sliding
    window w only those with p - k < w. Query head h reads KV head h // (num_heads // num_kv_heads).
    Scores, softmax and the weighted sum of values accumulate in float32."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    keys, values, key_scales, value_scales, kv_format = _cache_operands(key_cache, value_cache)
    _check_rows(query, keys, values, key_scales, value_scales)
    num_seqs = meta.seq_lens.numel()
    group = num_heads // num_kv_heads
    # tl.dot needs tiles of at least 16 rows. A decode program has one token, so its rows are
    # the group's heads and padding; prefill programs stack several tokens to reuse each key.
    block_m = max(16 if meta.max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    sliding = sliding_window is not None and sliding_window < meta.max_seq_len
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        keys,
        values,
        key_scales,
        value_scales,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * _LOG2_E,
        num_seqs,
        sliding_window if sliding else 0,
        meta.block_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *keys.stride()[:3],
        *values.stride()[:3],
        *key_scales.stride()[:3],
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=_block_n(meta.max_seq_len, head_dim_pad * query.element_size()),
        SLIDING=sliding,
        DOT_DTYPE=_dot_dtype(query),
        KV_FORMAT=kv_format,
        SCALE_GROUP=kv_quant.group_size(head_dim),
        # Named, not left to Triton's default, which changes in 3.10.
        enable_fp_fusion=True,
    )
    return out


def _cache_operands(
    key_cache: KVCacheTensor, value_cache: KVCacheTensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What the kernel reads: keys, values, their scales (`[blocks, block_size, kv_heads,
    scales_per_row]`, contiguous in the last dimension, the same strides for both; a float cache
    passes its keys, never read) and the format."""
    if not isinstance(key_cache, QuantizedCache):
        return key_cache, value_cache, key_cache, value_cache, _AS_IS
    if key_cache.scales.stride() != value_cache.scales.stride():
        raise ValueError("the key and value scales must have the same layout")
    if key_cache.scales.stride(-1) != 1:
        raise ValueError("a row's scales must be contiguous")
    if key_cache.dtype == torch.int8:
        keys, values, kv_format = key_cache.data, value_cache.data, _INT8
    elif key_cache.dtype == torch.float8_e4m3fn:
        keys, values = key_cache.data.view(torch.uint8), value_cache.data.view(torch.uint8)
        kv_format = _FP8
    else:
        raise ValueError(f"the Triton attention reads no {key_cache.dtype} cache")
    if key_cache.scales.dtype != kv_quant.SCALE_DTYPE:
        raise ValueError(f"expected {kv_quant.SCALE_DTYPE} scales, got {key_cache.scales.dtype}")
    return keys, values, key_cache.scales, value_cache.scales, kv_format


def _block_n(max_seq_len: int, row_bytes: int) -> int:
    """Keys per tile: 64, but 32 for short contexts (less masked work) and for rows of more than
    512 bytes (float32 head_dim 256), whose pipelined tiles would outgrow an A100's shared
    memory."""
    return 64 if max_seq_len > 32 and row_bytes <= 512 else 32


def _dot_dtype(query: torch.Tensor) -> tl.dtype:
    """Half-precision operands feed the tensor cores; on a CPU tensor (Triton's interpreter, which
    computes bfloat16 dots wrongly) every dot runs in float32."""
    if query.is_cuda and query.dtype == torch.float16:
        return tl.float16
    if query.is_cuda and query.dtype == torch.bfloat16:
        return tl.bfloat16
    return tl.float32


def _check_rows(*tensors: torch.Tensor) -> None:
    """The kernels address head_dim with unit stride."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"expected a unit stride in the last dimension, got {t.stride()}")
