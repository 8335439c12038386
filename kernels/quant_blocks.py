"""GGUF's (llama.cpp's) block-quantized weight formats: their layouts, and the reference
dequantizer that every kernel (`quant_matmul.c`, `quant_linear`) is checked against.

A quantized matrix `[rows, cols]` is stored row by row, each row as `cols / size` blocks of
`size` consecutive weights, packed with no padding (GGUF aligns whole tensors, not blocks); all
fields are little-endian; d, dmin and m are float16.

Blocks of 32 (weight i of the block; nibble(i) is the low four bits of qs[i] for i < 16, the high
four bits of qs[i - 16] for the rest; bit(i) is bit i of the 32-bit qh):

| format | ggml type | bytes | layout | weight i |
|---|---|---|---|---|
| Q4_0 | 2 | 18 | d, qs[16] | d * (nibble(i) - 8) |
| Q4_1 | 3 | 20 | d, m, qs[16] | d * nibble(i) + m |
| Q5_0 | 6 | 22 | d, qh[4], qs[16] | d * (nibble(i) + 16 * bit(i) - 16) |
| Q8_0 | 8 | 34 | d, qs[32] (int8) | d * qs[i] |

Super-blocks of 256, in sub-blocks (K formats):

| format | ggml type | bytes | layout |
|---|---|---|---|
| Q4_K | 12 | 144 | d, dmin, scales[12], qs[128] |
| Q5_K | 13 | 176 | d, dmin, scales[12], qh[32], qs[128] |
| Q6_K | 14 | 210 | ql[128], qh[64], scales[16] (int8), d |

- Q4_K: 8 sub-blocks of 32, each with a 6-bit scale sc[j] and minimum mn[j] packed in `scales`:
  for j < 4, sc = scales[j] & 63 and mn = scales[j + 4] & 63; for j >= 4, their low four bits
  are the low and high nibble of scales[j + 4] and their top two bits the top two bits of
  scales[j - 4] and scales[j]. qs holds 4 runs of 32 bytes; run g's low nibbles are sub-block
  2g, its high nibbles sub-block 2g + 1. Weight = d * sc[j] * q - dmin * mn[j].
- Q5_K: as Q4_K, with a fifth bit: bit j of qh[l] is the high bit of weight l of sub-block j.
- Q6_K: 16 sub-blocks of 16, each with an int8 scale. Each half of 128 weights takes 64 bytes of
  ql and 32 of qh: weight 32k + l of the half (k < 4, l < 32) has its low four bits in
  ql[l + 32 * (k % 2)] (the low nibble for k < 2, the high one after) and its top two bits at
  bit 2k of qh[l]; weight = d * scales[w / 16] * (q - 32).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights of a simple block
SUPER_BLOCK = 256  # weights of a K format's super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int
    size: int  # weights a block holds
    block_bytes: int


class Format(enum.Enum):
    """The block formats the kernels read, by their ggml type ids."""

    Q4_0 = BlockFormat("Q4_0", 2, BLOCK, 18)
    Q4_1 = BlockFormat("Q4_1", 3, BLOCK, 20)
    Q5_0 = BlockFormat("Q5_0", 6, BLOCK, 22)
    Q8_0 = BlockFormat("Q8_0", 8, BLOCK, 34)
    Q4_K = BlockFormat("Q4_K", 12, SUPER_BLOCK, 144)
    Q5_K = BlockFormat("Q5_K", 13, SUPER_BLOCK, 176)
    Q6_K = BlockFormat("Q6_K", 14, SUPER_BLOCK, 210)

    @property
    def ggml_type(self) -> int:
        return self.value.ggml_type

    @property
    def size(self) -> int:
        return self.value.size

    @property
    def block_bytes(self) -> int:
        return self.value.block_bytes

    def row_bytes(self, cols: int) -> int:
        """The stored bytes of one row of `cols` weights (a multiple of `size`)."""
        if cols % self.size:
            raise ValueError(f"a {self.name} row holds whole blocks of {self.size}, not {cols}")
        return cols // self.size * self.block_bytes

    def cols(self, row_bytes: int) -> int:
        """The weights of a stored row of `row_bytes`."""
        return row_bytes // self.block_bytes * self.size

    @classmethod
    def of(cls, ggml_type: int) -> Format | None:
        """The format of a ggml type id; None for one the kernels do not read."""
        return _BY_TYPE.get(int(ggml_type))


_BY_TYPE = {f.ggml_type: f for f in Format}


def dequantize(
    blocks: np.ndarray | torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The weights `[rows, cols]` of `blocks` (uint8 `[rows, row_bytes]`) in `dtype`.

    In float64 this is the reference: each weight is exact there (products of an 11-bit scale,
    a 6- or 8-bit sub-scale and a small integer, and one difference), so a kernel's error against
    it is the kernel's own. In float32 it is the fallback where the C kernels are not built."""
    if isinstance(blocks, np.ndarray):
        blocks = np.ascontiguousarray(blocks)
    raw = torch.as_tensor(blocks)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks are uint8 [rows, k * {fmt.block_bytes}]")
    rows = raw.shape[0]
    per_block = raw.reshape(rows, -1, fmt.block_bytes)
    return _DEQUANTIZE[fmt](per_block, dtype).reshape(rows, -1)


def _half(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float16 at each block's bytes `raw` (`[..., 2]`), as `[..., 1]` in `dtype`."""
    return raw.contiguous().view(torch.float16).to(dtype)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Each run of bytes' low nibbles, then its high nibbles, along the last axis."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """The eight bits of each byte of `raw`, lowest first: `[..., bytes, 8]`."""
    return (raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1


def _q4_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _half(b[..., 0:2], dtype) * (_nibbles(b[..., 2:18]).to(dtype) - 8)


def _q4_1(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _half(b[..., 0:2], dtype) * _nibbles(b[..., 4:20]).to(dtype) + _half(b[..., 2:4], dtype)


def _q5_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = _nibbles(b[..., 6:22]).to(dtype) + 16 * _bits(b[..., 2:6]).flatten(-2).to(dtype)
    return _half(b[..., 0:2], dtype) * (q - 16)


def _q8_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _half(b[..., 0:2], dtype) * b[..., 2:34].contiguous().view(torch.int8).to(dtype)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 8 six-bit scales and minimums of each super-block (`[..., 8]` each)."""
    first, second, rest = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([first & 63, (rest & 0x0F) | ((first >> 6) << 4)], dim=-1)
    mn = torch.cat([second & 63, (rest >> 4) | ((second >> 6) << 4)], dim=-1)
    return sc, mn


def _k_low_bits(qs: torch.Tensor) -> torch.Tensor:
    """The 4-bit parts of a Q4_K or Q5_K super-block, `[..., 8, 32]` by sub-block."""
    runs = qs.unflatten(-1, (4, 32))  # run g: sub-blocks 2g (low nibbles) and 2g + 1 (high)
    return torch.stack([runs & 0x0F, runs >> 4], dim=-2).flatten(-3, -2)


def _q4_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    sc, mn = _k_scales(b[..., 4:16])
    q = _k_low_bits(b[..., 16:144]).to(dtype)
    return _k_weights(b, sc, mn, q, dtype)


def _q5_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    sc, mn = _k_scales(b[..., 4:16])
    high = _bits(b[..., 16:48]).transpose(-1, -2)  # [..., sub-block j, weight l]: bit j of qh[l]
    q = _k_low_bits(b[..., 48:176]).to(dtype) + 16 * high.to(dtype)
    return _k_weights(b, sc, mn, q, dtype)


def _k_weights(
    b: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    d, dmin = _half(b[..., 0:2], dtype), _half(b[..., 2:4], dtype)
    scale = (d * sc.to(dtype)).unsqueeze(-1)
    low = (dmin * mn.to(dtype)).unsqueeze(-1)
    return (scale * q - low).flatten(-2)


def _q6_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ql = b[..., 0:128].unflatten(-1, (2, 2, 32))  # [..., half, which 32 bytes, l]
    qh = b[..., 128:192].unflatten(-1, (2, 32))  # [..., half, l]
    low = torch.stack([ql & 0x0F, ql >> 4], dim=-3)  # [..., half, nibble, k % 2, l]
    low = low.flatten(-3, -2)  # [..., half, k, l]: k = 2 * nibble + k % 2
    high = torch.stack([(qh >> (2 * k)) & 3 for k in range(4)], dim=-2)  # [..., half, k, l]
    q = (low | (high << 4)).to(dtype) - 32
    scales = b[..., 192:208].contiguous().view(torch.int8).to(dtype).unflatten(-1, (2, 8))
    d = _half(b[..., 208:210], dtype)[..., None, None]  # [..., 1, 1, 1]
    weights = q.flatten(-2).unflatten(-1, (8, 16)) * scales.unsqueeze(-1)  # [..., half, 8, 16]
    return (d * weights).flatten(-3)


_DEQUANTIZE = {
    Format.Q4_0: _q4_0,
    Format.Q4_1: _q4_1,
    Format.Q5_0: _q5_0,
    Format.Q8_0: _q8_0,
    Format.Q4_K: _q4_k,
    Format.Q5_K: _q5_k,
    Format.Q6_K: _q6_k,
}
