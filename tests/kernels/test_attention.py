"""Paged attention and the KV cache write, against a dense per-sequence reference."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from pagedbatch.kernels import attention
from pagedbatch.kernels.attention import paged_attention, prepare_attention, reshape_and_cache

# Every test runs twice: float32 decode through the C kernel, and through torch alone.
pytestmark = pytest.mark.usefixtures("native_path")

BLOCK_SIZE = 16
HEAD_DIM = 32
PAD_BLOCK = 2**30  # block-table padding: any read of it fails loudly

# (seq_len, query_len) per sequence, in batch order
SCENARIOS = {
    "decode": [(1, 1), (16, 1), (17, 1), (33, 1), (40, 1)],
    "prefill": [(5, 5), (16, 16), (23, 23), (2, 2)],
    "chunked_prefill": [(40, 8), (48, 16), (20, 3), (33, 17)],
    "mixed": [(30, 1), (17, 1), (1, 1), (25, 25), (50, 10)],
    "mixed_unordered": [(25, 25), (30, 1), (50, 10), (2, 1)],
    "decode_lengths_spread": [(700, 1), (40, 1), (31, 1), (20, 1), (3, 1)],
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    blocks: list[list[int]]  # each sequence's blocks, unpadded
    block_size: int = BLOCK_SIZE


def context_slots(blocks: list[int], seq_len: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Cache slots of positions 0..seq_len-1 of a sequence stored in `blocks`."""
    return torch.tensor(
        [blocks[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
    )


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
) -> Batch:
    """A batch whose whole context is already cached, in shuffled blocks of a cache whose other
    slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    blocks = []
    for n in blocks_needed:
        blocks.append(ids[:n])
        ids = ids[n:]
    block_tables = torch.full((len(seqs), max(blocks_needed) + 2), PAD_BLOCK, dtype=torch.int32)
    for i, seq_blocks in enumerate(blocks):
        block_tables[i, : len(seq_blocks)] = torch.tensor(seq_blocks)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for seq_blocks, (seq_len, _) in zip(blocks, seqs, strict=True):
        slots = context_slots(seq_blocks, seq_len, block_size)
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = kv[0].to(dtype)
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = kv[1].to(dtype)

    num_tokens = sum(q_len for _, q_len in seqs)
    # The model slices q out of a fused QKV projection, so the query is a strided view.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv.to(dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]),
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs]),
        blocks=blocks,
        block_size=block_size,
    )


def reference_attention(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """Dense float64 attention, one sequence at a time, masked by transformers' own mask rules."""
    mask_fn = (
        causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    )
    num_heads = batch.query.shape[1]
    group = num_heads // batch.key_cache.shape[2]
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        slots = context_slots(batch.blocks[i], seq_len, batch.block_size)
        k = batch.key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = batch.value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q = batch.query[start:end].double()
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = mask_fn(0, 0, q_pos, k_pos)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    meta = prepare_attention(
        batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size
    )
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, meta, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_dense_reference(scenario, heads, window, dtype):
    batch = make_batch(SCENARIOS[scenario], *heads, dtype=dtype)
    scale = HEAD_DIM**-0.5
    out = run(batch, scale, window)
    assert out.shape == batch.query.shape and out.dtype == dtype
    expected = reference_attention(batch, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [20, 64, 96, 256])
@pytest.mark.parametrize("scenario", ["mixed", "decode_lengths_spread"])
def test_float32_queries_read_a_half_precision_cache_as_it_holds_it(
    scenario, head_dim, cache_dtype
):
    """kv_cache_dtype float16 or bfloat16 under a float32 model: the keys and values are rounded
    once, as they are cached; attention over them is float32's (the C kernel widens each element
    exactly as it loads it, torch converts the gathered rows)."""
    batch = make_batch(SCENARIOS[scenario], 6, 2, head_dim=head_dim)
    batch.key_cache = batch.key_cache.to(cache_dtype)
    batch.value_cache = batch.value_cache.to(cache_dtype)
    scale = head_dim**-0.5
    out = run(batch, scale, 7)
    assert out.dtype == torch.float32
    expected = reference_attention(batch, scale, 7)  # of the values as the cache holds them
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_reshape_and_cache_rounds_float32_rows_into_a_half_precision_cache():
    key_cache = torch.zeros(4, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(2, 5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, 17, 18, 40, 63])
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, HEAD_DIM)[slots], key.half())
    assert torch.equal(value_cache.view(-1, 2, HEAD_DIM)[slots], value.half())


@pytest.mark.parametrize("head_dim", [20, 64, 96, 128, 256])
def test_head_sizes_the_c_kernel_specializes_or_not(head_dim):
    # 64, 128 and 256 run as constants; 96 does not; 20 is no multiple of the vector width.
    batch = make_batch(SCENARIOS["decode"] * 2, 6, 2, head_dim=head_dim)
    scale = head_dim**-0.5
    out = run(batch, scale, None)
    torch.testing.assert_close(
        out.double(), reference_attention(batch, scale, None), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("window", [None, 5, 20], ids=["full", "window5", "window20"])
@pytest.mark.parametrize("block_size", [1, 8, 32, 48])
def test_block_sizes_other_than_the_vector_width(block_size, window):
    # The C kernel reads a block in chunks of up to one vector's width of slots (8 or 16): blocks
    # smaller than a vector, and larger ones split in whole and partial chunks.
    seqs = SCENARIOS["decode_lengths_spread"] + [(97, 1), (64, 1)]
    batch = make_batch(seqs, 6, 2, block_size=block_size)
    out = run(batch, 0.2, window)
    torch.testing.assert_close(
        out.double(), reference_attention(batch, 0.2, window), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("window", [1, 16, 17, 10_000])
def test_window_edges(window):
    batch = make_batch([(40, 1), (33, 33), (48, 16)], 6, 2)
    out = run(batch, 0.2, window)
    torch.testing.assert_close(
        out.double(), reference_attention(batch, 0.2, window), atol=1e-5, rtol=0
    )


@pytest.fixture
def small_gather_budget(monkeypatch):
    """Gathers of 128 rows (2 KV heads of HEAD_DIM float32): real batches then span several
    gather chunks, and a long prefill outgrows the reused buffer."""
    monkeypatch.setattr(attention, "_GATHER_BYTES", 128 * 2 * 2 * HEAD_DIM * 4)
    monkeypatch.setattr(attention, "_local", threading.local())


@pytest.mark.usefixtures("small_gather_budget")
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize(
    "seqs",
    [
        SCENARIOS["decode"] + [(45, 1), (60, 1), (2, 1), (130, 1)],
        SCENARIOS["mixed"] + [(200, 200), (300, 50)],
    ],
    ids=["decode", "mixed_long"],
)
def test_batches_larger_than_one_gather(seqs, window):
    batch = make_batch(seqs, 6, 2)
    out = run(batch, 0.2, window)
    expected = reference_attention(batch, 0.2, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_one_metadata_serves_layers_with_different_windows():
    batch = make_batch(SCENARIOS["mixed"], 6, 2)
    meta = prepare_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    for window in [None, 7, None, 7]:
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, meta, 0.3, window)
        expected = reference_attention(batch, 0.3, window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_prepare_attention_derives_positions_slots_and_rope_lengths():
    batch = make_batch([(18, 1), (20, 4)], 4, 4)
    meta = prepare_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    (b0, b1), (c0, c1) = batch.blocks
    assert meta.positions.tolist() == [17, 16, 17, 18, 19]
    assert meta.slot_mapping.tolist() == [
        b1 * BLOCK_SIZE + 1,
        c1 * BLOCK_SIZE + 0,
        c1 * BLOCK_SIZE + 1,
        c1 * BLOCK_SIZE + 2,
        c1 * BLOCK_SIZE + 3,
    ]
    assert meta.rope_seq_lens.tolist() == [18, 20, 20, 20, 20]
    assert (meta.max_query_len, meta.max_seq_len) == (4, 20)


def test_reshape_and_cache_writes_where_the_block_table_says():
    seqs = [(20, 20), (35, 3), (17, 1)]
    batch = make_batch(seqs, 4, 2)
    meta = prepare_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    num_tokens = batch.query.shape[0]
    key = torch.randn(num_tokens, 2, HEAD_DIM)
    value = torch.randn(num_tokens, 2, HEAD_DIM)
    untouched_key = batch.key_cache.clone()
    reshape_and_cache(key, value, batch.key_cache, batch.value_cache, meta.slot_mapping)

    written = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    token = 0
    for seq_blocks, (seq_len, q_len) in zip(batch.blocks, seqs, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            block, offset = seq_blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            assert torch.equal(batch.key_cache[block, offset], key[token])
            assert torch.equal(batch.value_cache[block, offset], value[token])
            written[block, offset] = True
            token += 1
    torch.testing.assert_close(
        batch.key_cache[~written], untouched_key[~written], atol=0, rtol=0, equal_nan=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_only_float32_decode_goes_to_the_c_kernel(native_path, dtype):
    batch = make_batch(SCENARIOS["mixed"], 6, 2, dtype=dtype)
    meta = prepare_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    paged_attention(batch.query, batch.key_cache, batch.value_cache, meta, 0.3)
    (plan,) = meta._plans.values()
    in_place = native_path == "c_kernel" and dtype == torch.float32
    assert (plan.decode_rows is not None) == in_place
    assert len(plan.decode) == (0 if in_place else 1)  # three decode sequences, one chunk
    assert len(plan.prefill) == 2


@pytest.mark.usefixtures("small_gather_budget")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_chunk_after_a_long_context_reads_it_in_tiles_without_a_mask(dtype):
    """Nothing a long prefill chunk needs grows with its context but the number of tiles: no
    [queries, keys] mask, no gather beyond one tile (a decode outgrowing one gather alike)."""
    batch = make_batch([(1000, 64), (700, 1)], 6, 2, dtype=dtype)
    meta = prepare_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, meta, 0.2)
    expected = reference_attention(batch, 0.2, None)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    (plan,) = meta._plans.values()
    rows = attention._workspace(batch.key_cache, batch.key_cache.dtype).shape[1]  # one gather
    in_place = plan.decode_rows is not None  # the C kernel reads a decode's blocks in place
    assert [len(seq.tiles) for seq in plan.prefill] == [
        math.ceil(936 / rows) + 1,
        *([] if in_place else [math.ceil(699 / rows) + 1]),
    ]
    for seq in plan.prefill:
        assert all(t.mask is None and t.slots.numel() <= rows for t in seq.tiles[:-1])
        assert seq.tiles[-1].causal and seq.tiles[-1].mask is None
