"""x @ W.T with W held in a GGUF block format (`quant_blocks`), never dequantized whole; and the
objects a model holds such weights in (`QuantizedTensor` as loaded, `QuantizedWeight` as used).

Two paths, chosen by how many rows x has:
- a few (a decode step's sequences, up to `SMALL_BATCH`): the C kernel `quant_matmul`, which
  quantizes x per block to int8 and streams the blocks once, with integer dot products;
- more (prefill): tiles of W dequantized to float32 by the C kernel `quant_dequantize`, each
  multiplied by torch's float32 GEMM; one tile is in memory at a time.

Without the C kernels (no compiler, `PAGEDBATCH_NATIVE_KERNELS=0`) both paths take the tiles,
dequantized by `quant_blocks.dequantize` in float32: slower, the same arithmetic as the GEMM path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedbatch.kernels import native
from pagedbatch.kernels.quant_blocks import Format, dequantize

# Rows of x up to which the int8 path runs: its cost grows with the rows, the tiles' GEMM
# amortises the dequantization over them.
SMALL_BATCH = 8
# Weights dequantized a tile: 4 MiB of float32, which stays in a core's L2 while multiplied.
TILE_ELEMENTS = 1 << 20


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: Format, cols: int) -> torch.Tensor:
    """x `[..., cols]` (float32, CPU) times the transposed weights stored in `blocks` (uint8
    `[rows, fmt.row_bytes(cols)]`, contiguous): `[..., rows]` float32."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols).contiguous()
    lib = native.library()
    if lib is not None and x2.shape[0] <= SMALL_BATCH:
        out = _small_batch(lib, x2, blocks, fmt, cols)
    else:
        out = _tiles(lib, x2, blocks, fmt, cols)
    return out.reshape(*lead, blocks.shape[0])


def _small_batch(
    lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, fmt: Format, cols: int
) -> torch.Tensor:
    rows = blocks.shape[0]
    out = torch.empty(x.shape[0], rows)
    status = lib.quant_matmul(
        fmt.ggml_type, blocks.data_ptr(), rows, cols,
        x.data_ptr(), x.shape[0], torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    _check(status, fmt)
    return out


def _tiles(
    lib: ctypes.CDLL | None, x: torch.Tensor, blocks: torch.Tensor, fmt: Format, cols: int
) -> torch.Tensor:
    rows = blocks.shape[0]
    out = torch.empty(x.shape[0], rows)
    step = max(1, TILE_ELEMENTS // cols)
    tile = torch.empty(min(step, rows), cols) if lib is not None else None
    for start in range(0, rows, step):
        part = blocks[start : start + step]
        if lib is None:
            weights = dequantize(part, fmt, torch.float32)
        else:
            weights = tile[: part.shape[0]]
            status = lib.quant_dequantize(
                fmt.ggml_type, part.data_ptr(), part.shape[0], cols,
                torch.get_num_threads(), weights.data_ptr(),
            )  # fmt: skip
            _check(status, fmt)
        torch.mm(x, weights.t(), out=out[:, start : start + part.shape[0]])
    return out


def _check(status: int, fmt: Format) -> None:
    if status == -2:
        raise MemoryError("quant_matmul could not allocate its activations' scratch")
    if status != 0:
        raise ValueError(f"the C kernels do not read {fmt.name} rows of this width")


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight `[rows, cols]` as its stored blocks (uint8 `[rows, fmt.row_bytes(cols)]`): what
    a GGUF checkpoint hands the loaders for a tensor the kernels read. Indexing it dequantizes
    (to float32) the rows asked for, so a loader that does not keep blocks reads it as a tensor
    (an embedding, a linear split across ranks)."""

    blocks: torch.Tensor
    fmt: Format
    cols: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.cols))

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        return dequantize(self.blocks[rows], self.fmt, torch.float32)[(slice(None), *rest)]


class QuantizedWeight:
    """A linear's weight kept in its blocks: `weight(x, bias)` is x @ W.T + bias by
    `quant_matmul`, for float32 x on the CPU. Built from the linear's parts in order (q, k and v
    of a fused projection), which share one format and width (see `join`)."""

    def __init__(self, blocks: torch.Tensor, fmt: Format, cols: int):
        self.blocks, self.fmt, self.cols = blocks.contiguous(), fmt, cols

    @classmethod
    def join(cls, parts: list[QuantizedTensor]) -> QuantizedWeight | None:
        """The parts' rows one after the other; None where their formats or widths differ
        (a file may store q and v of one layer in different formats)."""
        first = parts[0]
        if any(p.fmt is not first.fmt or p.cols != first.cols for p in parts):
            return None
        blocks = torch.cat([p.blocks for p in parts]) if len(parts) > 1 else first.blocks
        return cls(blocks, first.fmt, first.cols)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = quant_matmul(x, self.blocks, self.fmt, self.cols)
        return out if bias is None else out.add_(bias)
