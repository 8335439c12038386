"""The Triton paged attention and KV cache write against the torch path (the reference)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedbatch.kernels import attention, triton_attention
from pagedbatch.kernels.attention import AttentionMetadata, prepare_attention

BLOCK_SIZE = 16
HEAD_DIM = 32
PAD_BLOCK = 2**30  # block-table padding: any read of it fails loudly

# (seq_len, query_len) per sequence, in batch order
SCENARIOS = {
    # a one-token sequence, exactly one block, one past a block, mid-block, several key tiles
    "decode": [(1, 1), (16, 1), (17, 1), (40, 1), (70, 1)],
    "prefill": [(5, 5), (16, 16), (23, 23), (2, 2)],
    # cached prefixes; chunks crossing block boundaries and ending mid-block
    "chunked_prefill": [(40, 8), (48, 16), (20, 3), (100, 17)],
    "mixed": [(30, 1), (17, 1), (1, 1), (25, 25), (50, 10)],
}
HEADS = {"mha": (4, 4), "gqa3": (6, 2)}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata


def cached_batch(
    device: str,
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = BLOCK_SIZE,
    head_dim: int = HEAD_DIM,
) -> Batch:
    """A batch whose whole context is already cached, in shuffled blocks of a cache whose other
    slots hold NaN, with block tables padded past the cache's end: a read of anything but the
    sequences' own keys shows in the output."""
    gen = torch.Generator().manual_seed(0)
    blocks_needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seqs), max(blocks_needed) + 2), PAD_BLOCK, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, (seq_len, _) in enumerate(seqs):
        blocks, ids = ids[: blocks_needed[i]], ids[blocks_needed[i] :]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = kv[0]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = kv[1]

    num_tokens = sum(q_len for _, q_len in seqs)
    # The model slices q out of a fused QKV projection, so the query is a strided view.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv.to(dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    meta = prepare_attention(
        torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(device),
        torch.tensor([seq_len for seq_len, _ in seqs], device=device),
        block_tables.to(device),
        block_size,
    )
    return Batch(query.to(device), key_cache.to(device), value_cache.to(device), meta)


def assert_matches_torch_path(batch: Batch, scale: float, window: int | None) -> None:
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, scale, window)
    out = triton_attention.paged_attention(*args)
    expected = attention.paged_attention(*args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tolerance = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_the_torch_path(scenario, heads, window, dtype, device):
    assert_matches_torch_path(
        cached_batch(device, SCENARIOS[scenario], *heads, dtype=dtype), 0.2, window
    )


@pytest.mark.parametrize("window", [1, 16, 17, 10_000])
def test_window_edges(window, device):
    """Windows of one key (its own), of a block, one past a block, wider than any context."""
    assert_matches_torch_path(
        cached_batch(device, [(40, 1), (33, 33), (48, 16)], 6, 2), 0.2, window
    )


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_any_block_size(block_size, device):
    """Key tiles gather across many blocks, or lie within one."""
    batch = cached_batch(device, SCENARIOS["mixed"], 6, 2, block_size=block_size)
    assert_matches_torch_path(batch, 0.2, None)


@pytest.mark.parametrize("heads", [(16, 1), (32, 1)], ids=["group16", "group32"])
def test_large_groups(heads, device):
    """One query token per program row block (group 16), or a block wider than 16 rows."""
    assert_matches_torch_path(cached_batch(device, [(20, 1), (9, 9), (30, 4)], *heads), 0.2, 7)


def test_head_dim_not_a_power_of_two(device):
    batch = cached_batch(device, SCENARIOS["chunked_prefill"], 4, 2, head_dim=40)
    assert_matches_torch_path(batch, 40**-0.5, None)


def test_prefill_longer_than_one_program(device):
    """A sequence's query tokens split over several programs, each with its own causal limit."""
    assert_matches_torch_path(cached_batch(device, [(150, 140), (70, 1)], 4, 4), 0.2, 50)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_the_same_slots(dtype, device):
    seqs = [(20, 20), (35, 3), (17, 1)]
    batch = cached_batch(device, seqs, 4, 2, dtype=dtype)
    num_tokens = batch.query.shape[0]
    # k and v arrive as strided views of the fused QKV projection.
    qkv = torch.randn(num_tokens, 8 * HEAD_DIM, device=device).to(dtype)
    key = qkv[:, 4 * HEAD_DIM : 6 * HEAD_DIM].view(num_tokens, 2, HEAD_DIM)
    value = qkv[:, 6 * HEAD_DIM :].view(num_tokens, 2, HEAD_DIM)
    assert_writes_as_the_torch_path(key, value, batch)


def assert_writes_as_the_torch_path(key: torch.Tensor, value: torch.Tensor, batch: Batch) -> None:
    caches = batch.key_cache, batch.value_cache
    expected = [c.clone() for c in caches]
    triton_attention.reshape_and_cache(key, value, *caches, batch.meta.slot_mapping)
    attention.reshape_and_cache(key, value, *expected, batch.meta.slot_mapping)
    for cache, want in zip(caches, expected, strict=True):
        torch.testing.assert_close(cache, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_precision_cache_under_float32_queries(cache_dtype, device):
    # kv_cache_dtype float16 or bfloat16 for a float32 model: the write rounds, reads widen.
    batch = cached_batch(device, SCENARIOS["mixed"], 6, 2)
    batch.key_cache, batch.value_cache = (
        batch.key_cache.to(cache_dtype),
        batch.value_cache.to(cache_dtype),
    )
    assert_matches_torch_path(batch, 0.2, 7)
    key, value = torch.randn(2, batch.query.shape[0], 2, HEAD_DIM, device=device)
    assert_writes_as_the_torch_path(key, value, batch)
