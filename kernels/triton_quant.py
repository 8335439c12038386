"""x @ W.T with W in a GGUF block format (`quant_blocks`), as Triton kernels: the CUDA path
beside `quant_linear`'s C kernels, reading the same bytes.

The blocks are uploaded as they are stored (uint8 `[rows, row_bytes]`, no repacking), so that a
tied LM head and the embedding share one copy on the GPU as they do on the CPU, and every kernel
reads the layout `quant_blocks` documents. Each program dequantizes a `[BLOCK_K, BLOCK_N]` tile of
W inside its K loop, in float32 (every weight its exact value rounded once, as the C kernels
compute it), and multiplies it with the activations' tile: float16/bfloat16 activations meet
the tile rounded to their dtype on the tensor cores; float32 ones are multiplied in float32
(IEEE, not TF32). Sums are float32. Every float16 field of every format lies at an even offset
of an even-sized block, so the kernels read them through a float16 view of the same bytes.

Two configurations, by the activations' rows M:
- few (a decode step, up to `SMALL_M`): one tile of rows, narrow column tiles, and K split
  across programs where the column tiles alone would leave most of the GPU idle; the splits'
  float32 partial sums are added by torch (deterministic, unlike atomics);
- more (prefill): square tiles, K whole in each program.

Each weight of a tile finds its block's fields by its own index (the same bytes are read by many
lanes: the cache serves them), so a tile of K need not match the format's block; where K is not
a multiple of the tile the last one is masked, the weights past K read as zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedbatch.kernels.quant_blocks import Format

# Rows of x up to which the decode configuration runs: one tile of 16 rows, tl.dot's smallest.
SMALL_M = 16
# Programs the decode configuration aims for, per streaming multiprocessor, when splitting K.
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# Dequantized tiles of 4096 weights, 32 a thread of 4 warps: a K format's dozen temporaries a
# weight stay within the registers (64 a thread would spill them).
DECODE = TileConfig(block_m=16, block_n=32, block_k=128, num_warps=4)
PREFILL = TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4)
# Off CUDA, in Triton's interpreter (tests), whose cost is per program and op rather than per
# element: few programs of wide tiles.
INTERPRETER = TileConfig(block_m=16, block_n=128, block_k=256, num_warps=4)


def config_for(m: int, on_cuda: bool) -> TileConfig:
    """The tiles for `m` rows of activations."""
    if not on_cuda:
        return INTERPRETER
    return DECODE if m <= SMALL_M else PREFILL


@triton.jit
def _half(halves, byte_offset, mask):
    """The float16 field at an even byte offset, in float32."""
    return tl.load(halves + byte_offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _byte(data, byte_offset, mask):
    return tl.load(data + byte_offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _weights(
    data,
    halves,
    rows,
    ks,
    mask,
    row_bytes,
    FMT: tl.constexpr,
    SIZE: tl.constexpr,
    BYTES: tl.constexpr,
):
    """The float32 weights W[rows, ks] (`rows` along axis 1, `ks` along axis 0: a
    `[BLOCK_K, BLOCK_N]` tile of W.T), each its exact value rounded once; zero where masked.
    FMT is the ggml type, SIZE and BYTES its block's weights and bytes; the arithmetic follows
    quant_blocks' table."""
    i = (ks % SIZE)[:, None]  # the weight's place in its block
    base = rows[None, :].to(tl.int64) * row_bytes + (ks // SIZE * BYTES)[:, None]
    if FMT == 2:  # Q4_0
        d = _half(halves, base, mask)
        qs = _byte(data, base + 2 + i % 16, mask)
        q = tl.where(i < 16, qs & 15, qs >> 4)
        w = d * (q - 8).to(tl.float32)
    elif FMT == 3:  # Q4_1
        d = _half(halves, base, mask)
        m = _half(halves, base + 2, mask)
        qs = _byte(data, base + 4 + i % 16, mask)
        q = tl.where(i < 16, qs & 15, qs >> 4)
        w = d * q.to(tl.float32) + m
    elif FMT == 6:  # Q5_0
        d = _half(halves, base, mask)
        qh = _byte(data, base + 2 + i // 8, mask)
        qs = _byte(data, base + 6 + i % 16, mask)
        q = tl.where(i < 16, qs & 15, qs >> 4) + 16 * ((qh >> (i % 8)) & 1)
        w = d * (q - 16).to(tl.float32)
    elif FMT == 8:  # Q8_0
        d = _half(halves, base, mask)
        q = tl.load(data + base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = d * q.to(tl.float32)
    elif FMT == 12 or FMT == 13:  # Q4_K, Q5_K
        j = i // 32  # the sub-block: its 6-bit scale and minimum
        low = j < 4
        s_j = _byte(data, base + 4 + j, mask)
        s_j4 = _byte(data, base + 8 + j, mask)
        s_jm4 = _byte(data, base + 4 + tl.where(low, j, j - 4), mask)
        sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
        mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        if FMT == 12:
            qs = _byte(data, base + 16 + 32 * (j // 2) + i % 32, mask)
            q = tl.where(j % 2 == 0, qs & 15, qs >> 4)
        else:  # the fifth bit: bit j of qh[l]
            qs = _byte(data, base + 48 + 32 * (j // 2) + i % 32, mask)
            qh = _byte(data, base + 16 + i % 32, mask)
            q = tl.where(j % 2 == 0, qs & 15, qs >> 4) + 16 * ((qh >> j) & 1)
        d = _half(halves, base, mask)
        dmin = _half(halves, base + 2, mask)
        # d * (sc * q) and dmin * mn are exact in float32; their difference rounds once.
        w = d * (sc * q).to(tl.float32) - dmin * mn.to(tl.float32)
    else:  # Q6_K
        half = i // 128
        k = i % 128 // 32
        lane = i % 32  # the layout's l
        ql = _byte(data, base + 64 * half + lane + 32 * (k % 2), mask)
        qh = _byte(data, base + 128 + 32 * half + lane, mask)
        q = tl.where(k < 2, ql & 15, ql >> 4) | (((qh >> (2 * k)) & 3) << 4)
        sc = tl.load(data + base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _half(halves, base + 208, mask)
        # sc * (q - 32) is an integer of 13 bits: times d, exact in float32 but for one rounding.
        w = d * (sc.to(tl.int32) * (q - 32)).to(tl.float32)
    return w


@triton.jit
def _quant_matmul_kernel(
    x,
    data,
    halves,
    out,
    m,
    n,
    k,
    row_bytes,
    k_per_split,
    stride_xm,
    stride_split,
    stride_om,
    FMT: tl.constexpr,
    SIZE: tl.constexpr,
    BYTES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[split, rows, cols] = x[rows, this split's ks] @ W[cols, those ks].T, in float32."""
    xrows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_start = split * k_per_split
    k_end = tl.minimum(k, k_start + k_per_split)
    xrow_ok = xrows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        a = tl.load(
            x + xrows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=xrow_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = _weights(data, halves, cols, ks, w_ok, row_bytes, FMT, SIZE, BYTES)
        acc = tl.dot(a, w.to(DOT_DTYPE), acc, input_precision="ieee")
    tl.store(
        out + split * stride_split + xrows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc,
        mask=xrow_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _dequantize_kernel(
    data,
    halves,
    out,
    n,
    k,
    row_bytes,
    stride_on,
    FMT: tl.constexpr,
    SIZE: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[rows, ks] = W[rows, ks], in out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (ks < k)[:, None] & (rows < n)[None, :]
    w = _weights(data, halves, rows, ks, mask, row_bytes, FMT, SIZE, BYTES)
    tl.store(
        out + rows[None, :].to(tl.int64) * stride_on + ks[:, None],
        w.to(out.dtype.element_ty),
        mask=mask,
    )


def _check(blocks: torch.Tensor, fmt: Format, cols: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError(f"{fmt.name} blocks are contiguous uint8 [rows, row_bytes]")
    if blocks.shape[1] != fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name} rows of {cols} weights take {fmt.row_bytes(cols)} bytes")


def _dot_dtype(x: torch.Tensor) -> tl.dtype:
    """Half-precision activations feed the tensor cores; on a CPU tensor (Triton's
    interpreter, which computes bfloat16 dots wrongly) every dot runs in float32."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        return tl.float16 if x.dtype == torch.float16 else tl.bfloat16
    return tl.float32


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_for(x: torch.Tensor, n: int, k: int, config: TileConfig) -> int:
    """How many splits of K the decode configuration takes: enough programs to fill the GPU
    (`_PROGRAMS_PER_SM` a multiprocessor), no split shorter than a tile; one off CUDA."""
    if not x.is_cuda:
        return 1
    col_tiles = triton.cdiv(n, config.block_n)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _multiprocessors(x.device.index or 0), col_tiles)
    return max(1, min(wanted, triton.cdiv(k, config.block_k)))


def quant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    cols: int,
    config: TileConfig | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x `[..., cols]` (float16, bfloat16 or float32) times the transposed weights stored in
    `blocks` (uint8 `[rows, fmt.row_bytes(cols)]`, contiguous, on x's device): `[..., rows]` in
    x's dtype. `config` and `split_k` default to the decode or prefill choice by x's rows."""
    _check(blocks, fmt, cols)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], blocks.shape[0]
    if config is None:
        config = config_for(m, x2.is_cuda)
    if split_k is None:
        split_k = split_for(x2, n, cols, config) if config is DECODE else 1
    # Each split a whole number of tiles: only the last split's last tile is ragged.
    k_per_split = triton.cdiv(triton.cdiv(cols, split_k), config.block_k) * config.block_k
    splits = triton.cdiv(cols, k_per_split)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
    _quant_matmul_kernel[grid](
        x2,
        blocks,
        blocks.view(torch.float16),
        partial,
        m,
        n,
        cols,
        blocks.shape[1],
        k_per_split,
        x2.stride(0),
        partial.stride(0),
        partial.stride(1),
        FMT=fmt.ggml_type,
        SIZE=fmt.size,
        BYTES=fmt.block_bytes,
        DOT_DTYPE=_dot_dtype(x2),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )
    out = partial[0] if splits == 1 else partial.sum(0)
    return out.to(x.dtype).reshape(*lead, n)


def dequantize(
    blocks: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights `[rows, cols]` of `blocks` (as `quant_matmul` takes them) in `dtype`: each
    weight's exact value rounded once to float32, then to `dtype`. An embedding's lookup."""
    _check(blocks, fmt, cols)
    rows = blocks.shape[0]
    out = torch.empty(rows, cols, dtype=dtype, device=blocks.device)
    if rows == 0:
        return out
    block_n, block_k = 32, 128
    grid = (triton.cdiv(rows, block_n), triton.cdiv(cols, block_k))
    _dequantize_kernel[grid](
        blocks,
        blocks.view(torch.float16),
        out,
        rows,
        cols,
        blocks.shape[1],
        out.stride(0),
        FMT=fmt.ggml_type,
        SIZE=fmt.size,
        BYTES=fmt.block_bytes,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
