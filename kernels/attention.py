"""Paged attention over a flattened token batch: the torch path (the CPU path, and the reference the
Triton kernels are tested against).

The KV cache of a layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`; a
token's slot is `block_id * block_size + offset`. A step's tokens are all sequences' query tokens
concatenated without padding; sequence i owns `query[query_start_loc[i]:query_start_loc[i + 1]]`,
the last positions of its context of `seq_lens[i]` tokens, whose K/V are in the cache before
attention runs.

Per step, the engine calls `prepare_attention` once and hands the result to every layer:

    meta = prepare_attention(query_start_loc, seq_lens, block_tables, block_size)
    # each layer:
    reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    out = paged_attention(q, key_cache, value_cache, meta, scale, sliding_window)

CPU strategy: decode sequences (one query token) in float32 go to the C kernel
(`cpu_attention.c`, see `native`), which reads their keys and values in place from the blocks.
Everything else goes through torch, which cannot compute on scattered blocks in place: each call
gathers the keys and values it needs into a dense buffer (one `index_select` each) and hands them
to `scaled_dot_product_attention`, whose CPU kernel accumulates in float32 for fp16/bf16. There,
decode sequences are batched: sorted by context length, cut into chunks whose gathered K/V stay
cache-sized, each chunk padded to its longest context and masked; prefill chunks run one sequence
at a time. Gather indices and masks depend only on the step, the layer's sliding window, the
cache's row size and whether the C kernel runs, so they are built on first use and shared by every
layer of the step.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedbatch.kernels import kv_quant, native
from pagedbatch.kernels.kv_quant import KVCacheTensor, QuantizedCache

# Keys plus values gathered per decode call. Measured on the 2-core CPU: one gather of a whole
# 64 x 400 batch ran up to twice as slow as chunks of 4-16 MiB, whose copy is still cached when
# attention reads it; smaller chunks pay more in per-call overhead than they save.
_GATHER_BYTES = 16 * 2**20
# A decode chunk is cut short where its remaining sequences are at most half as long as its
# longest and together would be padded by at least this many rows: a shorter cut costs more in
# extra calls than the padding does.
_MIN_SPLIT_SAVING = 1024


@dataclass
class _DecodeChunk:
    """Sequences with one query token each, attended in one batched call."""

    token_idx: torch.Tensor  # [n] their tokens' rows in the flattened batch
    slots: torch.Tensor  # [n * kv_len] cache slots of the keys each one attends, padded
    mask: torch.Tensor  # [n, 1, 1, kv_len] additive: 0 for keys attended, -inf for padding
    kv_len: int


@dataclass
class _KeyTile:
    """Keys a sequence's queries attend in one call."""

    slots: torch.Tensor  # [num_keys] their cache slots, in order
    mask: torch.Tensor | None  # [q_len, num_keys] additive; None: see `causal`
    causal: bool  # without a mask: the queries are these keys' positions (causal), or after all


@dataclass
class _PrefillSeq:
    """One sequence with several query tokens (or a decode too long for one gather), attended
    alone: in one call over its keys, or over tiles of them combined by their log-sum-exp."""

    start: int  # its tokens are rows start:end of the flattened batch
    end: int
    tiles: list[_KeyTile]


@dataclass
class _DecodeRows:
    """Every decode sequence, for the C kernel: sequence j attends keys first_keys[j] ..
    seq_lens[j] - 1 through row table_rows[j] of `tables`; its query is row token_rows[j]."""

    token_rows: torch.Tensor  # int64 each
    table_rows: torch.Tensor
    first_keys: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor  # the step's block tables as the kernel reads them: contiguous int32


@dataclass
class _Plan:
    decode: list[_DecodeChunk]
    prefill: list[_PrefillSeq]
    decode_rows: _DecodeRows | None = None  # instead of `decode`, where the C kernel runs


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer. Build it with `prepare_attention`."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    block_size: int
    positions: torch.Tensor  # [num_tokens] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, the cache slot each token's K/V goes to
    rope_seq_lens: torch.Tensor  # [num_tokens] int64, its sequence's seq_len (dynamic NTK RoPE)
    max_query_len: int
    max_seq_len: int
    _query_lens: list[int] = field(repr=False)
    _seq_lens: list[int] = field(repr=False)
    # keyed by (sliding window, query dtype, gathered rows per decode call, C kernel or not)
    _plans: dict[tuple[int | None, torch.dtype, int, bool], _Plan] = field(
        default_factory=dict, repr=False
    )


def prepare_attention(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionMetadata:
    """Describes one step: sequence i has tokens query_start_loc[i]:query_start_loc[i + 1] of the
    flattened batch, the last of its seq_lens[i] positions, stored in the blocks of
    block_tables[i] (padded with anything past its last block). All on the model's device."""
    query_start_loc = query_start_loc.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    device = seq_lens.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_tokens = int(query_start_loc[-1])
    seq_of_token = torch.repeat_interleave(
        torch.arange(seq_lens.numel(), device=device), query_lens, output_size=num_tokens
    )
    first_position = seq_lens - query_lens
    positions = (
        torch.arange(num_tokens, device=device)
        - query_start_loc[seq_of_token]
        + first_position[seq_of_token]
    )
    query_lens_list = query_lens.tolist()
    seq_lens_list = seq_lens.tolist()
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        block_size=block_size,
        positions=positions,
        slot_mapping=_slots(block_tables, block_size, seq_of_token, positions),
        rope_seq_lens=seq_lens[seq_of_token],
        max_query_len=max(query_lens_list, default=0),
        max_seq_len=max(seq_lens_list, default=0),
        _query_lens=query_lens_list,
        _seq_lens=seq_lens_list,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value `[num_tokens, num_kv_heads, head_dim]` into their slots of the cache
    (quantized, each row with its scale, into a QuantizedCache)."""
    if isinstance(key_cache, QuantizedCache):
        kv_quant.write(key_cache, key, slot_mapping)
        kv_quant.write(value_cache, value, slot_mapping)
        return
    num_kv_heads, head_dim = key_cache.shape[2:]
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)  # rounded, where it is less
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


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
    window w only those with p - k < w (as transformers' Mistral and Qwen2 do). Query head h reads
    KV head h // (num_heads // num_kv_heads). A quantized cache's rows, or a cache's of another
    dtype than the query's, are converted to the query's dtype as they are gathered (the C kernel
    converts in its inner loop)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    converted = isinstance(key_cache, QuantizedCache) or key_cache.dtype != query.dtype
    buffer = _workspace(key_cache, query.dtype)
    max_rows = buffer.shape[1]
    in_place = query.dtype == torch.float32 and query.device.type == "cpu"
    lib = native.library() if in_place else None
    plan = _plan(meta, sliding_window, query.dtype, max_rows, lib is not None)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if converted:  # into fresh tensors: their bytes are not the cache's
            return (
                kv_quant.gather(key_cache, slots, query.dtype),
                kv_quant.gather(value_cache, slots, query.dtype),
            )
        keys = key_cache.view(-1, num_kv_heads, head_dim)
        values = value_cache.view(-1, num_kv_heads, head_dim)
        n = slots.numel()
        if n > max_rows:  # one long prefill: a buffer of its own, not kept
            return keys.index_select(0, slots), values.index_select(0, slots)
        k = torch.index_select(keys, 0, slots, out=buffer[0, :n])
        v = torch.index_select(values, 0, slots, out=buffer[1, :n])
        return k, v

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if plan.decode_rows is not None:
        _decode_in_place(lib, query.contiguous(), key_cache, value_cache, meta, plan.decode_rows,
                         scale, out)  # fmt: skip
    for chunk in plan.decode:
        n = chunk.token_idx.numel()
        # The query heads sharing a KV head play the part of SDPA's query sequence.
        q = query.index_select(0, chunk.token_idx).view(n, num_kv_heads, -1, head_dim)
        k, v = gather(chunk.slots)
        k = k.view(n, chunk.kv_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(n, chunk.kv_len, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
        out.index_copy_(0, chunk.token_idx, o.reshape(n, num_heads, head_dim))
    for seq in plan.prefill:
        q = query[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
        if len(seq.tiles) > 1:
            out[seq.start : seq.end] = _tiled(q, seq.tiles, gather, scale)[0].transpose(0, 1)
            continue
        (tile,) = seq.tiles
        k, v = gather(tile.slots)
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=tile.mask,
            is_causal=tile.causal,
            scale=scale,
            enable_gqa=True,
        )
        out[seq.start : seq.end] = o[0].transpose(0, 1)
    return out


def _tiled(
    q: torch.Tensor,
    tiles: list[_KeyTile],
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Attention of `q` `[1, num_heads, q_len, head_dim]` over the tiles' keys (unmasked tiles:
    all attended, or causal), one tile at a time: each call's output and log-sum-exp are folded
    into a float32 running result (the online softmax), so no buffer grows with the context
    beyond one tile."""
    _, num_heads, q_len, head_dim = q.shape
    total = acc = None
    for tile in tiles:
        k, v = gather(tile.slots)
        num_kv_heads = k.shape[1]
        groups = num_heads // num_kv_heads
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if tile.causal:  # each query head against its KV head's keys
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            o, lse = _flash(q, k, v, True, scale)
        else:  # every query attends every key: a KV head's query heads share one call
            folded = q.reshape(1, num_kv_heads, groups * q_len, head_dim)
            o, lse = _flash(folded, k, v, False, scale)
            o, lse = o.reshape(q.shape), lse.reshape(1, num_heads, q_len)
        o, lse = o.float(), lse.float()
        if acc is None:
            total, acc = lse, o
            continue
        combined = torch.logaddexp(total, lse)
        acc = acc * (total - combined).exp_()[..., None] + o * (lse - combined).exp_()[..., None]
        total = combined
    return acc.to(q.dtype)


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel: the output and each query's log-sum-exp of its scores."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


# The C kernel's codes for the cache formats it reads (cpu_attention.h's `enum kv_format`).
C_FORMATS = {
    torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2, torch.bfloat16: 3, torch.float16: 4
}  # fmt: skip


def _decode_in_place(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: KVCacheTensor,
    value_cache: KVCacheTensor,
    meta: AttentionMetadata,
    rows: _DecodeRows,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim = query.shape[1:]
    tables = rows.tables
    if isinstance(key_cache, QuantizedCache):
        caches = (key_cache.data, value_cache.data, key_cache.scales, value_cache.scales)
    else:
        caches = (key_cache, value_cache, None, None)
    fmt = C_FORMATS.get(key_cache.dtype)
    if fmt is None:
        raise ValueError(f"the C decode kernel reads no {key_cache.dtype} cache")
    status = lib.paged_decode_attention_kv(
        query.data_ptr(), *(0 if t is None else t.data_ptr() for t in caches), fmt,
        kv_quant.group_size(head_dim),
        tables.data_ptr(), tables.shape[1],
        rows.token_rows.data_ptr(), rows.table_rows.data_ptr(), rows.first_keys.data_ptr(),
        rows.seq_lens.data_ptr(), rows.token_rows.numel(),
        num_heads, key_cache.shape[2], head_dim, meta.block_size,
        scale, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the decode attention kernel could not allocate its scores")


_local = threading.local()


def _workspace(cache: KVCacheTensor, dtype: torch.dtype) -> torch.Tensor:
    """A `[2, rows, num_kv_heads, head_dim]` buffer for gathered keys and values in `dtype` (the
    query's), kept per thread and layout: a fresh one per call would cost page faults on every
    layer."""
    buffers: dict[tuple, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    device, row_shape = cache.device, tuple(cache.shape[2:])
    key = (dtype, device, row_shape)
    if key not in buffers:
        row_bytes = row_shape[0] * row_shape[1] * dtype.itemsize
        rows = max(1, _GATHER_BYTES // (2 * row_bytes))
        # A normal tensor, not an inference one: it may be written in and out of inference mode.
        with torch.inference_mode(False):
            buffers[key] = torch.empty((2, rows, *row_shape), dtype=dtype, device=device)
    return buffers[key]


def _plan(
    meta: AttentionMetadata,
    sliding_window: int | None,
    dtype: torch.dtype,
    max_rows: int,
    in_place: bool,
) -> _Plan:
    if sliding_window is not None and sliding_window >= meta.max_seq_len:
        sliding_window = None  # a window wider than every context changes nothing
    key = (sliding_window, dtype, max_rows, in_place)
    if key not in meta._plans:
        meta._plans[key] = _build_plan(meta, sliding_window, dtype, max_rows, in_place)
    return meta._plans[key]


def _build_plan(
    meta: AttentionMetadata, window: int | None, dtype: torch.dtype, max_rows: int, in_place: bool
) -> _Plan:
    starts = meta.query_start_loc.tolist()
    decode: list[int] = []
    prefill: list[_PrefillSeq] = []
    for i, (q_len, seq_len) in enumerate(zip(meta._query_lens, meta._seq_lens, strict=True)):
        keys = seq_len - _first_key(seq_len - q_len, window)
        if q_len == 1 and (in_place or keys <= max_rows):
            decode.append(i)
        elif q_len >= 1:
            prefill.append(
                _prefill_seq(meta, i, starts[i], q_len, seq_len, window, dtype, max_rows)
            )
    if in_place and decode:
        return _Plan([], prefill, _decode_rows(meta, decode, starts, window))
    return _Plan(_decode_chunks(meta, decode, starts, window, dtype, max_rows), prefill)


def decode_rows(meta: AttentionMetadata, sliding_window: int | None) -> _DecodeRows | None:
    """The C decode kernel's rows of a step whose sequences all have one query token (the plan
    `paged_attention` follows on a CPU with the C kernels); None for any other step."""
    if meta.max_query_len != 1:
        return None
    if sliding_window is not None and sliding_window >= meta.max_seq_len:
        sliding_window = None
    return _plan(meta, sliding_window, torch.float32, 0, True).decode_rows


def _first_key(position: int, window: int | None) -> int:
    """The earliest key a query at `position` attends."""
    return 0 if window is None else max(0, position - window + 1)


def _slots(
    block_tables: torch.Tensor, block_size: int, seq: int | torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Cache slots of `positions` (any shape) of sequence(s) `seq` (broadcast against them)."""
    blocks = block_tables[seq, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size


def _prefill_seq(
    meta: AttentionMetadata,
    seq: int,
    start: int,
    q_len: int,
    seq_len: int,
    window: int | None,
    dtype: torch.dtype,
    max_rows: int,
) -> _PrefillSeq:
    device = meta.seq_lens.device
    first_query = seq_len - q_len
    first_key = _first_key(first_query, window)

    def slots(first: int, end: int) -> torch.Tensor:
        positions = torch.arange(first, end, device=device)
        return _slots(meta.block_tables, meta.block_size, seq, positions)

    if window is None and first_key < first_query:
        # A chunk after others: the keys before it, which every query attends, in tiles of one
        # gather each, then the chunk's own keys, causally. No mask: nothing grows with the
        # context but the number of tiles.
        past = [
            _KeyTile(slots(a, min(a + max_rows, first_query)), None, False)
            for a in range(first_key, first_query, max_rows)
        ]
        return _PrefillSeq(
            start, start + q_len, [*past, _KeyTile(slots(first_query, seq_len), None, True)]
        )
    mask = None
    # SDPA's is_causal aligns the first query with the first key, which is only right when the
    # chunk is the whole of the context it attends; else a sliding window's mask, at most
    # q_len x (q_len + window), which does not grow with the context either.
    if first_key != first_query or (window is not None and seq_len - first_key > window):
        key_pos = torch.arange(first_key, seq_len, device=device)
        query_pos = torch.arange(first_query, seq_len, device=device)[:, None]
        attended = (key_pos <= query_pos) & (query_pos - key_pos < (window or seq_len))
        mask = _additive(attended, dtype)
    tile = _KeyTile(slots(first_key, seq_len), mask, mask is None)
    return _PrefillSeq(start, start + q_len, [tile])


def _decode_rows(
    meta: AttentionMetadata, seqs: list[int], starts: list[int], window: int | None
) -> _DecodeRows:
    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return _DecodeRows(
        token_rows=column([starts[i] for i in seqs]),
        table_rows=column(seqs),
        first_keys=column([_first_key(meta._seq_lens[i] - 1, window) for i in seqs]),
        seq_lens=column([meta._seq_lens[i] for i in seqs]),
        tables=meta.block_tables.to(torch.int32).contiguous(),
    )


def _decode_chunks(
    meta: AttentionMetadata,
    seqs: list[int],
    starts: list[int],
    window: int | None,
    dtype: torch.dtype,
    max_rows: int,
) -> list[_DecodeChunk]:
    if not seqs:
        return []
    first_keys = {i: _first_key(meta._seq_lens[i] - 1, window) for i in seqs}
    kv_len = {i: meta._seq_lens[i] - first_keys[i] for i in seqs}
    # Longest first, so each chunk pads to its first member's length.
    order = sorted(seqs, key=kv_len.__getitem__, reverse=True)
    chunks: list[list[int]] = [[order[0]]]
    for rank, i in enumerate(order[1:], start=1):
        longest = kv_len[chunks[-1][0]]
        full = (len(chunks[-1]) + 1) * longest > max_rows
        saving = (len(order) - rank) * (longest - kv_len[i])
        if full or (2 * kv_len[i] <= longest and saving >= _MIN_SPLIT_SAVING):
            chunks.append([i])
        else:
            chunks[-1].append(i)

    device = meta.seq_lens.device
    result = []
    for members in chunks:
        width = kv_len[members[0]]
        seq = torch.tensor(members, device=device)
        first = torch.tensor([first_keys[i] for i in members], device=device)[:, None]
        last = meta.seq_lens[seq][:, None] - 1
        key_pos = first + torch.arange(width, device=device)
        attended = key_pos <= last
        # Padding repeats the sequence's own last key, so it never reads an unwritten slot
        # whose garbage (say NaN) would survive the mask.
        positions = torch.minimum(key_pos, last)
        slots = _slots(meta.block_tables, meta.block_size, seq[:, None], positions)
        result.append(
            _DecodeChunk(
                token_idx=torch.tensor([starts[i] for i in members], device=device),
                slots=slots.flatten(),
                mask=_additive(attended, dtype)[:, None, None, :],
                kv_len=width,
            )
        )
    return result


def _additive(attended: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(attended.shape, dtype=dtype, device=attended.device)
    return mask.masked_fill_(~attended, float("-inf"))
