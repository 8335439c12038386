"""A quantized KV cache (`kv_cache_dtype` int8 or fp8): each cached key or value row of one head
is stored as one byte an element plus a float32 scale per group of GROUP (32) elements, so
attention reads a little over half the bytes of a bfloat16 cache and a quarter of a float32 one.

Layout of one layer's keys (values alike), beside the unquantized cache's
`[num_blocks, block_size, num_kv_heads, head_dim]`:

    data    [num_blocks, block_size, num_kv_heads, head_dim]             int8 or float8_e4m3fn
    scales  [num_blocks, block_size, num_kv_heads, head_dim // group]    float32

and element d of row (slot, head) is `data[..., d] * scales[..., d // group]`, where
`group = group_size(head_dim)`. A group's scale is its largest magnitude over the format's
largest value (127 for int8, 448 for e4m3), so the group's extreme lands on the format's.

Why scales per (token, head) and not per (block, head): a block fills one token at a time
during decode, so a block-wide scale would either be fixed by the block's first token (clipping
later, larger ones) or have to grow, requantizing the block's earlier rows on each write (a
read-modify-write, and rounding twice). A row's own scales are final when it is written and need
no calibration.

Why groups of 32 within a row (llama.cpp's q8_0 block): keys have a few channels far larger than
the rest (Gemma 3 270M: the channels' RMS up to 20-60x the median in some layers, and the row's
largest element on one of four channels in nearly every row), so one scale per row of 256 left
the other elements a coarse step: Gemma's perplexity rose 1.19% over int8 and 1.31% over fp8
(gates 0.5% and 1%). With a scale per 32 elements an outlier coarsens only its own group
(benchmarks/README.md has the measurements of 32, 64 and 128). The scales cost 4 bytes per 32,
12.5% beside the int8 data. In the kernels a group's scale multiplies that group's partial dot
product (a key) or the softmax weight for that group's elements (a value): one multiply per
group, never per element.

int8 rounds to nearest (error at most scale / 2 an element, a group's amax / 254); e4m3 keeps 3
mantissa bits (relative error at most 2^-4, below 2^-6 * scale a step of 2^-9 * scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Engine argument values (`kv_cache_dtype`): auto stores K and V in the activations' dtype (in
# float16 where float32 activations run on GGUF blocks, see `storage_dtype`), a float name in that
# dtype (a float32 model's keys and values rounded to it as they are cached), a quantized name as
# above.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "int8")
FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The largest magnitude each format holds: a group's scale maps its extreme onto it.
LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
# Elements a scale covers, where the head size is a multiple of it (every model's but tiny ones).
GROUP = 32


def group_size(head_dim: int) -> int:
    """Elements of a row each scale covers: GROUP, or where head_dim is no multiple of it (16, 40)
    the largest power of two dividing both, so that a row is whole groups."""
    return math.gcd(head_dim, GROUP)


def scales_per_row(head_dim: int) -> int:
    """Scales of one head's row of one token."""
    return head_dim // group_size(head_dim)


@dataclass(frozen=True)
class QuantizedCache:
    """One layer's keys (or values), quantized: see the module's docstring for the layout. It
    stands where a cache tensor would, so it answers `shape`, `dtype` and `device` as the data
    does (code that needs a float cache, such as the fused decode layer, sees int8 or fp8 and
    keeps off it)."""

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


KVCacheTensor = torch.Tensor | QuantizedCache


def storage_dtype(
    kv_cache_dtype: str, activations: torch.dtype, quantized_weights: bool = False
) -> torch.dtype:
    """The dtype a cache's elements are stored in under the engine argument. auto is the
    activations' dtype, except float32 activations on quantized weights (quantization gguf): there
    float16, as llama.cpp's cache and a GGUF's in vLLM (whose activations are 16-bit). Its outputs
    are already the quantized weights' approximation and checked by quality gates, not token for
    token, and a cache of half the bytes holds twice the tokens and halves what decode attention
    reads: a SmolLM2 Q4_1 decode step of 128 sequences, 212 -> 185 ms on a Zen 4 EPYC."""
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized_weights and activations == torch.float32 else activations
    if kv_cache_dtype in FLOATS:
        return FLOATS[kv_cache_dtype]
    if kv_cache_dtype not in QUANTIZED:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return QUANTIZED[kv_cache_dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """A cache dtype as kv_cache_dtype names it (fp8, int8), or the activations' dtype's name."""
    for name, quantized in QUANTIZED.items():
        if dtype == quantized:
            return name
    return str(dtype).removeprefix("torch.")


def bytes_per_row(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one head's row of one token takes in a cache of `dtype` (its scales included)."""
    if dtype in LARGEST:
        return head_dim + scales_per_row(head_dim) * SCALE_DTYPE.itemsize
    return head_dim * dtype.itemsize


def empty_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> KVCacheTensor:
    """An uninitialised cache of `shape` `[blocks, block_size, kv_heads, head_dim]` (attention
    reads only slots that were written): a tensor, or a QuantizedCache for int8 and fp8."""
    if dtype not in LARGEST:
        return torch.empty(shape, dtype=dtype, device=device)
    return QuantizedCache(
        torch.empty(shape, dtype=dtype, device=device),
        torch.empty((*shape[:-1], scales_per_row(shape[-1])), dtype=SCALE_DTYPE, device=device),
    )


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[..., head_dim]` as (data in `dtype`, float32 scales `[..., scales_per_row]`). An
    all-zero group gets scale 1 (any would do)."""
    head_dim = x.shape[-1]
    groups = x.float().unflatten(-1, (scales_per_row(head_dim), group_size(head_dim)))
    largest = LARGEST[dtype]
    scales = groups.abs().amax(dim=-1) / largest
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = (groups / scales[..., None]).clamp_(-largest, largest)
    if dtype == torch.int8:
        y = y.round_()
    return y.flatten(-2).to(dtype), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `data * scales` (each scale over its group) in `dtype`, computed in float32."""
    groups = data.float().unflatten(-1, (scales.shape[-1], -1))
    return (groups * scales[..., None]).flatten(-2).to(dtype)


def write(cache: QuantizedCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantizes rows `[num_tokens, num_kv_heads, head_dim]` into the cache's `slots`."""
    data, scales = quantize(rows, cache.dtype)
    num_kv_heads, head_dim = cache.shape[2:]
    # Through uint8 views: index_copy_ has no float8 kernels on every device.
    flat = cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat.index_copy_(0, slots, data.view(torch.uint8))
    cache.scales.view(-1, num_kv_heads, scales.shape[-1]).index_copy_(0, slots, scales)


def gather(cache: KVCacheTensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of `slots` (any shape) as `[*slots.shape, num_kv_heads, head_dim]` in `dtype`,
    dequantized where the cache is quantized."""
    num_kv_heads, head_dim = cache.shape[2:]
    if isinstance(cache, torch.Tensor):
        return cache.view(-1, num_kv_heads, head_dim)[slots].to(dtype)
    flat = slots.reshape(-1)
    raw = cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    data = raw.index_select(0, flat).view(cache.dtype)
    groups = cache.scales.shape[-1]
    scales = cache.scales.view(-1, num_kv_heads, groups).index_select(0, flat)
    return dequantize(data, scales, dtype).view(*slots.shape, num_kv_heads, head_dim)


def cache_tensors(cache: KVCacheTensor) -> tuple[torch.Tensor, ...]:
    """The tensors a cache is held in (for counting its bytes)."""
    return (cache,) if isinstance(cache, torch.Tensor) else (cache.data, cache.scales)
