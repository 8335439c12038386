"""The Triton paged attention over a quantized KV cache (kv_quant: int8 or float8 e4m3 rows, a
float32 scale per group of 32 elements of a slot's KV head) against the torch path over the same
cache, which test_kv_quant.py holds to the float64 reference; and the cache write, which the
Triton module hands to torch."""

from __future__ import annotations

import pytest
import torch
from test_kv_quant import fp8_bytes, one_key_batch
from test_triton_attention import SCENARIOS, TOLERANCE, cached_batch

from pagedbatch.kernels import attention, kv_quant, triton_attention
from pagedbatch.kernels.kv_quant import QuantizedCache

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized(cache: torch.Tensor, dtype: torch.dtype) -> QuantizedCache:
    """The cache quantized; unwritten slots (NaN) get NaN scales, so reading one shows."""
    unwritten = cache.isnan().any(dim=-1)
    data, scales = kv_quant.quantize(torch.nan_to_num(cache.cpu()), dtype)
    scales[unwritten.cpu()] = float("nan")
    return QuantizedCache(data.to(cache.device), scales.to(cache.device))


def assert_matches_torch_path(device, seqs, heads, fmt, window=None, dtype=torch.float32,
                              block_size=16, head_dim=32):  # fmt: skip
    batch = cached_batch(device, seqs, *heads, block_size=block_size, head_dim=head_dim)
    keys = quantized(batch.key_cache, FORMATS[fmt])
    values = quantized(batch.value_cache, FORMATS[fmt])
    query = batch.query.to(dtype)
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query, keys, values, batch.meta, scale, window)
    expected = attention.paged_attention(query, keys, values, batch.meta, scale, window)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("scenario", ["decode", "chunked_prefill", "mixed"])
def test_matches_the_torch_path(scenario, window, fmt, device):
    assert_matches_torch_path(device, SCENARIOS[scenario], (6, 2), fmt, window)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_queries(dtype, fmt, device):
    assert_matches_torch_path(device, SCENARIOS["mixed"], (4, 4), fmt, dtype=dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_the_models_head_sizes(head_dim, fmt, device):
    assert_matches_torch_path(device, SCENARIOS["decode"], (6, 2), fmt, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [1, 5])
def test_block_tails(block_size, device):
    seqs = [(1, 1), (block_size + 3, 1), (3 * block_size + 6, 5)]
    for fmt in FORMATS:
        assert_matches_torch_path(device, seqs, (6, 2), fmt, block_size=block_size)


def test_every_fp8_value_widens_exactly(device):
    values = fp8_bytes()
    query, keys, vals, meta = one_key_batch(values, torch.float8_e4m3fn)
    moved = [QuantizedCache(c.data.to(device), c.scales.to(device)) for c in (keys, vals)]
    meta = attention.prepare_attention(
        meta.query_start_loc.to(device), meta.seq_lens.to(device), meta.block_tables.to(device), 1
    )
    out = triton_attention.paged_attention(query.to(device), *moved, meta, 1.0)
    expected = values.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(out[0, 0].cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_write_stores_what_the_torch_write_stores(fmt, device):
    shape = (5, 4, 2, 32)
    caches = [kv_quant.empty_cache(shape, FORMATS[fmt], torch.device(device)) for _ in range(4)]
    for cache in caches:
        cache.data.view(torch.uint8).zero_()
        cache.scales.zero_()
    key, value = torch.randn(2, 6, 2, 32, device=device)
    slots = torch.tensor([3, 17, 0, 19, 9, 4], device=device)
    triton_attention.reshape_and_cache(key, value, caches[0], caches[1], slots)
    attention.reshape_and_cache(key, value, caches[2], caches[3], slots)
    for ours, torch_s in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.data.view(torch.uint8), torch_s.data.view(torch.uint8))
        assert torch.equal(ours.scales, torch_s.scales)
