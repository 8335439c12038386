"""A quantized KV cache (`kv_cache_dtype` int8 or fp8): each cached key or value row of one head
is stored as one byte an element plus one float32 scale, so attention reads about half the bytes
of a bfloat16 cache and a quarter of a float32 one.

Layout of one layer's keys (values alike), beside the unquantized cache's
`[num_blocks, block_size, num_kv_heads, head_dim]`:

    data    [num_blocks, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn
    scales  [num_blocks, block_size, num_kv_heads]            float32

and row (slot, head) holds `data * scale`. The scale is the row's largest magnitude over the
format's largest value (127 for int8, 448 for e4m3), so the row's extreme lands on the format's.

Why a scale per (token, head) and not per (block, head): a block fills one token at a time
during decode, so a block-wide scale would either be fixed by the block's first token (clipping
later, larger ones) or have to grow, requantizing the block's earlier rows on each write (a
read-modify-write, and rounding twice). A row's own scale is final when it is written, uses the
format's whole range whatever its neighbours hold, and costs 4 bytes next to head_dim (6% of an
int8 row of 64). In the kernels it costs no per-element work: a key's scale multiplies its dot
product with the query (one multiply a score), a value's scale its softmax weight, so the inner
loops only widen bytes to floats. e4m3 with its own scale is vLLM's fp8 KV format (there a
scale per tensor, calibrated or 1.0; here per row, which needs no calibration).

int8 rounds to nearest (error at most scale / 2 an element, amax / 254); e4m3 keeps 3 mantissa
bits (relative error at most 2^-4, below 2^-6 * scale a step of 2^-9 * scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Engine argument values (`kv_cache_dtype`): auto stores K and V in the activations' dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The largest magnitude each format holds: a row's scale maps its extreme onto it.
LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


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


def storage_dtype(kv_cache_dtype: str, activations: torch.dtype) -> torch.dtype:
    """The dtype a cache's elements are stored in under the engine argument."""
    if kv_cache_dtype == "auto":
        return activations
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
    """Bytes one head's row of one token takes in a cache of `dtype` (its scale included)."""
    if dtype in LARGEST:
        return head_dim + SCALE_DTYPE.itemsize
    return head_dim * dtype.itemsize


def empty_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> KVCacheTensor:
    """An uninitialised cache of `shape` `[blocks, block_size, kv_heads, head_dim]` (attention
    reads only slots that were written): a tensor, or a QuantizedCache for int8 and fp8."""
    if dtype not in LARGEST:
        return torch.empty(shape, dtype=dtype, device=device)
    return QuantizedCache(
        torch.empty(shape, dtype=dtype, device=device),
        torch.empty(shape[:-1], dtype=SCALE_DTYPE, device=device),
    )


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[..., head_dim]` as (data in `dtype`, float32 scales `[...]`). An all-zero row gets
    scale 1 (any would do)."""
    x = x.float()
    largest = LARGEST[dtype]
    scales = x.abs().amax(dim=-1) / largest
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = (x / scales[..., None]).clamp_(-largest, largest)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `data * scales` in `dtype`, computed in float32."""
    return (data.float() * scales[..., None]).to(dtype)


def write(cache: QuantizedCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantizes rows `[num_tokens, num_kv_heads, head_dim]` into the cache's `slots`."""
    data, scales = quantize(rows, cache.dtype)
    num_kv_heads, head_dim = cache.shape[2:]
    # Through uint8 views: index_copy_ has no float8 kernels on every device.
    flat = cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat.index_copy_(0, slots, data.view(torch.uint8))
    cache.scales.view(-1, num_kv_heads).index_copy_(0, slots, scales)


def gather(cache: KVCacheTensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of `slots` (any shape) as `[*slots.shape, num_kv_heads, head_dim]` in `dtype`,
    dequantized where the cache is quantized."""
    num_kv_heads, head_dim = cache.shape[2:]
    if isinstance(cache, torch.Tensor):
        return cache.view(-1, num_kv_heads, head_dim)[slots].to(dtype)
    flat = slots.reshape(-1)
    raw = cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    data = raw.index_select(0, flat).view(cache.dtype)
    scales = cache.scales.view(-1, num_kv_heads).index_select(0, flat)
    return dequantize(data, scales, dtype).view(*slots.shape, num_kv_heads, head_dim)


def cache_tensors(cache: KVCacheTensor) -> tuple[torch.Tensor, ...]:
    """The tensors a cache is held in (for counting its bytes)."""
    return (cache,) if isinstance(cache, torch.Tensor) else (cache.data, cache.scales)
