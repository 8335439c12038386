"""GGUF's (llama.cpp's) block-quantized weight formats: their layouts, and the reference
dequantizer that every kernel (`quant_matmul.c`, `quant_linear`) is checked against.

A quantized matrix `[rows, cols]` is stored row by row; each row is `cols / 32` blocks of 32
consecutive weights, and each block holds a float16 scale `d` (and for Q4_1 a float16 minimum
`m`) followed by the 32 quants:

| format | ggml type | bytes a block | layout | weight i of the block |
|---|---|---|---|---|
| Q4_0 | 2 | 18 | d, qs[16] | d * (nibble(i) - 8) |
| Q4_1 | 3 | 20 | d, m, qs[16] | d * nibble(i) + m |
| Q8_0 | 8 | 34 | d, qs[32] (int8) | d * qs[i] |

nibble(i) is the low four bits of qs[i] for i < 16 and the high four bits of qs[i - 16] for the
rest: a block's first half sits in the low nibbles, its second half in the high ones. All fields
are little-endian, and blocks are packed with no padding (GGUF aligns whole tensors, not blocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights a block holds, in every format here


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int
    block_bytes: int
    # Bytes ahead of the quants: d, or d and m.
    header_bytes: int


class Format(enum.Enum):
    """The block formats the kernels read, by their ggml type ids."""

    Q4_0 = BlockFormat("Q4_0", 2, 18, 2)
    Q4_1 = BlockFormat("Q4_1", 3, 20, 4)
    Q8_0 = BlockFormat("Q8_0", 8, 34, 2)

    @property
    def ggml_type(self) -> int:
        return self.value.ggml_type

    @property
    def block_bytes(self) -> int:
        return self.value.block_bytes

    def row_bytes(self, cols: int) -> int:
        """The stored bytes of one row of `cols` weights (a multiple of `BLOCK`)."""
        if cols % BLOCK:
            raise ValueError(f"a {self.name} row holds whole blocks of {BLOCK}, not {cols}")
        return cols // BLOCK * self.block_bytes

    @classmethod
    def of(cls, ggml_type: int) -> Format | None:
        """The format of a ggml type id; None for one the kernels do not read."""
        return _BY_TYPE.get(int(ggml_type))


_BY_TYPE = {f.ggml_type: f for f in Format}


def dequantize(
    blocks: np.ndarray | torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The weights `[rows, cols]` of `blocks` (uint8 `[rows, row_bytes]`) in `dtype`.

    In float64 this is the reference: each weight d * q (+ m) is exact there (an 11-bit scale
    times a small integer), so a kernel's error against it is the kernel's own. In float32 it is
    the fallback where the C kernels are not built: d * q + m is rounded once or twice there."""
    raw = torch.as_tensor(
        np.ascontiguousarray(blocks) if isinstance(blocks, np.ndarray) else blocks
    )
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks are uint8 [rows, k * {fmt.block_bytes}]")
    rows = raw.shape[0]
    per_block = raw.reshape(rows, -1, fmt.block_bytes)
    d = per_block[..., 0:2].contiguous().view(torch.float16).to(dtype)  # [rows, blocks, 1]
    quants = per_block[..., fmt.value.header_bytes :]
    if fmt is Format.Q8_0:
        return (d * quants.view(torch.int8).to(dtype)).reshape(rows, -1)
    # Low nibbles are the block's weights 0-15, high nibbles its weights 16-31.
    nibbles = torch.cat([quants & 0x0F, quants >> 4], dim=-1).to(dtype)
    if fmt is Format.Q4_0:
        return (d * (nibbles - 8)).reshape(rows, -1)
    m = per_block[..., 2:4].contiguous().view(torch.float16).to(dtype)
    return (d * nibbles + m).reshape(rows, -1)
