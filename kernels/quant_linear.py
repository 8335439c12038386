"""x @ W.T with W held in a GGUF block format (`quant_blocks`), never dequantized whole; and the
objects a model holds such weights in (`QuantizedTensor` as loaded, `QuantizedWeight` as used).

Two paths, chosen by how many rows x has:
- a few (a decode step's sequences, up to `small_batch()`): the C kernels of quant_matmul.c, which
  stream the blocks once, expanding them in registers, on the activations asked for
  (`ACTIVATIONS`): `quant_matmul_float` multiplies x as it is; `quant_matmul_int16` quantizes x
  per block of 32 to int16 and multiplies integers (1.25 to 1.5x as fast on AVX2, each
  activation within 2^-16 of its block's largest); `quant_matmul_int8`, for a format of
  `INT8_FORMATS`, to int8 as llama.cpp does (as fast as int16, 258 times as coarse);
- more (prefill, a decode step of many sequences): `quant_gemm.c`, which expands each panel of
  32 rows of W once a call and multiplies it with every row of x: on AMX tiles or AVX512-BF16,
  each weight and activation split in two bf16 and three products summed (bf16x3, float32's
  accuracy near enough: greedy answers follow exact mode's, where one bf16 product
  (`PAGEDBATCH_QUANT_GEMM=bf16`) parted from them in 3 chats of 16); or with x quantized per 32
  to int16 (the few-row kernels' int16) or int8 (llama.cpp's arithmetic) and VNNI's integer
  products (AVX2's on CPUs without VNNI), the weights their stored integers (see
  quant_gemm.c).
  `gemm_path` says which: by default bf16x3 on AMX for large weights in the formats it expands
  fastest, else int16 on VNNI or AVX2 CPUs, else the tiles below. A greedy step's LM head is
  screened by a cheaper product with a bound on its error (`QuantizedWeight.approximate`: bf16
  on AMX, else int8), and only its candidates are exact.
  Where the CPU has none of these, or `PAGEDBATCH_QUANT_GEMM=float32` asks (exact mode's
  arithmetic), tiles of W dequantized to float32 by the C kernel `quant_dequantize`, each
  multiplied by oneDNN's float32 GEMM; one tile in memory at a time.

Where quant_matmul.c streams a format's blocks (AVX2 and AVX-512) models take int16 activations
or float32, whichever is the faster on this CPU (`few_row_activations`: int16 on AVX2 cores, float
on Zen 5); int16's greedy tokens agree with exact mode's as the float path's do (the float path:
SmolLM2, 8 chats, 137 tokens of 137; int8: 5 of 8 answers whole; Gemma 3 270M's K formats, 24
prompts of 32 tokens in steps of 6: 768 of 768, int8 536); in the portable build, float32, and
int8 for a format of `INT8_BY_DEFAULT` (there Q6_K's float path dequantizes each row, 15x slower
than its int8 path). `PAGEDBATCH_QUANT_ACTIVATIONS` (read when a model's weights are loaded)
says otherwise: `int16`, `int8` or `float32` for every format that kernel reads.

Without the C kernels (no compiler, `PAGEDBATCH_NATIVE_KERNELS=0`) both paths take the tiles,
dequantized by `quant_blocks.dequantize` in float32: slower, the same arithmetic as the GEMM path.

On CUDA (blocks uploaded as stored) the Triton kernels of `triton_quant` multiply and look rows
up instead, in the activations' dtype; on the CPU too where `PAGEDBATCH_KERNELS=triton` says so
(Triton's interpreter, for tests). Triton is imported only then.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedbatch.kernels import few_row_activations, native, ops, quant_gemm
from pagedbatch.kernels.quant_blocks import Format, dequantize

ACTIVATIONS_SETTING = "PAGEDBATCH_QUANT_ACTIVATIONS"
# The activations a few-row product takes, by the number decode_layer.c knows them by.
ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2}
_KERNELS = {
    "float32": "quant_matmul_float",
    "int8": "quant_matmul_int8",
    "int16": "quant_matmul_int16",
}
GEMM_SETTING = "PAGEDBATCH_QUANT_GEMM"
# The formats quant_matmul_int8 reads; the others take float activations where int8 is asked.
INT8_FORMATS = frozenset({Format.Q4_0, Format.Q4_1, Format.Q8_0, Format.Q4_K, Format.Q6_K})
# Those on the int8 path by default where no streaming code reads them with float or int16
# activations (see the top and `quant_float_streamed`).
INT8_BY_DEFAULT = frozenset({Format.Q4_K, Format.Q6_K})
# Rows of x up to which the streaming paths run (`small_batch`): their cost grows with the rows
# (each block expanded once for 8 of them), the many-row paths' GEMM amortises expanding the
# weights over all. 8 where quant_gemm.c has a bf16 path (AMX's bf16x3; on AVX512-BF16 CPUs
# VNNI's int16 passed streaming at 12 rows); 64 on other CPUs with the AVX2 kernels: a SmolLM2
# decode step's products took 215 ms streamed at 64 rows against the float32 tiles' 292 (32
# rows: 101 against 198; 96 rows: 461 against 270; int16, 2 threads of a Zen 3 EPYC).
SMALL_BATCH = 8
STREAMED_BATCH = 64
# Rows past which the LM head's screen (`QuantizedWeight.approximate`) pays where few-row products
# stream up to STREAMED_BATCH: on a Zen 3 EPYC, Gemma 3's Q8_0 head at 32 rows took 163-191 ms
# by int8 against streaming's 167-186, at 48 rows 247-255 against 297-319, at 64 278-305 against
# 413-444.
SCREEN_BATCH = 32
# The formats whose many rows keep the float32 tiles by default where the integer products are
# AVX2's (no VNNI): their dequantization is cheap, and vpmaddwd retires no more products than FMA.
# A Zen 3 EPYC, decode steps of 128 rows: SmolLM2 (Q4_1) 698-716 ms on int16 against the tiles'
# 531-647; Gemma 3's Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K) 674-849 on int16, its layers one C call
# each, against 1015-1047.
TILES_ON_AVX2 = frozenset({Format.Q4_0, Format.Q4_1})
# Where the CPU has VNNI's int16 too, AMX's bf16x3 takes a weight by default only in a format that
# quant_gemm.c expands to bf16 by vector code of its own (the others go through the scalar
# dequantizer) and of at least AMX_MIN_ROWS rows (it converts x to bf16 parts once a call, by
# scatters, which fewer rows do not pay for). 128 rows of x, 2 threads of an AMX Xeon, ms,
# bf16x3 against int16: Q4_1 3072 x 576 0.92/1.31, 2048 x 640 0.77/1.02, 1024 x 640 0.49/0.54,
# 960 x 576 0.43/0.44, 576 x 1536 0.83/0.74, 256 x 640 0.30/0.16; Q8_0 alike; Q5_0 3072 x 576
# 1.33/1.30, 640 x 2048 1.73/1.02; Q4_K 640 x 2048 1.43/1.04; Q6_K 640 x 2048 2.42/1.11.
AMX_FORMATS = frozenset({Format.Q4_0, Format.Q4_1, Format.Q8_0})
AMX_MIN_ROWS = 2048
# Weights dequantized a tile: 4 MiB of float32, which stays in a core's L2 while multiplied.
TILE_ELEMENTS = 1 << 20
# oneDNN compiles a primitive for each shape it multiplies and keeps it (about half a MiB each, not
# all handed back when evicted): with a primitive for each row count a step had, SmolLM2's 128
# chats held 348 MiB more than on MKL's sgemm. The tiles give it pieces of x of LARGE_PIECE_ROWS,
# else of at most PIECE_ROWS padded to a multiple of PIECE_MULTIPLE: 9 shapes a tile. A prefill's
# 2048 rows took 10.8 ms in pieces of 512, 12.9 in pieces of 128, 9.5 at once (MKL's 22.7; a tile
# of 1820 x 576, 2 threads).
PIECE_ROWS = 128
PIECE_MULTIPLE = 16
LARGE_PIECE_ROWS = 512
# Added to the norms of `QuantizedWeight.error_bound`'s bound: its products with each other
# exceed what bf16's flush of subnormal values and products can change in a sum.
SUBNORMAL_SLACK = 2.0**-50


def activations_for(fmt: Format) -> str:
    """The activations (an `ACTIVATIONS` name) that few-row products of `fmt` take, as
    `PAGEDBATCH_QUANT_ACTIVATIONS` says:
    - `auto` (the default): where the C kernels stream `fmt` both ways, int16 or float32, the
      faster on this CPU (`few_row_activations`); else int8 for a format of `INT8_BY_DEFAULT`,
      else float32;
    - `int16`, `int8` or `float32`: that, where its kernel reads `fmt` (else float32).
    Without the C kernels: float32 (the tiles), whatever is asked."""
    value = os.environ.get(ACTIVATIONS_SETTING, "auto").strip().lower()
    if value not in ("auto", *ACTIVATIONS):
        raise ValueError(f"{ACTIVATIONS_SETTING} is auto, float32, int16 or int8, not {value!r}")
    lib = native.library()
    if lib is None or value == "float32":
        return "float32"
    if value == "auto" and (choice := few_row_activations.chosen(lib).get(fmt)) is not None:
        return choice
    if value in ("auto", "int16") and lib.quant_int16_streamed(fmt.ggml_type):
        return "int16"
    if value == "int8":
        return "int8" if fmt in INT8_FORMATS else "float32"
    return "int8" if value == "auto" and fmt in INT8_BY_DEFAULT else "float32"


def gemm_path(fmt: Format, rows: int | None = None) -> tuple[str, str] | None:
    """The product many rows of x take with a weight of `rows` rows (None: any) in `fmt`, and
    its `quant_gemm` path, as `PAGEDBATCH_QUANT_GEMM` says:
    - `auto` (the default): bf16x3 on AMX tiles where the CPU has them (where it has VNNI too,
      for a weight in a format of `AMX_FORMATS` of at least `AMX_MIN_ROWS` rows alone); else
      int16 activations on AVX512-VNNI, else on AVX2 but for the formats of `TILES_ON_AVX2`
      (bf16x3 on AVX512-BF16 took 2.8x the float32 tiles' time: benchmarks/README.md);
    - `bf16x3` or `bf16` (one product): on the fastest bf16 path (AMX, else AVX512-BF16);
    - `int16` or `int8`: integer activations on VNNI, else AVX2;
    - `float32`: None.
    None: the float32 tiles (exact mode's arithmetic), also where the asked product has no fast
    path here or no compiler."""
    value = os.environ.get(GEMM_SETTING, "auto").strip().lower()
    if value not in (*quant_gemm.PRODUCTS, "auto", "float32"):
        raise ValueError(
            f"{GEMM_SETTING} is auto, bf16x3, bf16, int16, int8 or float32, not {value!r}"
        )
    if value == "auto":
        integer = quant_gemm.fastest_integer()
        large = fmt in AMX_FORMATS and (rows is None or rows >= AMX_MIN_ROWS)
        if "amx" in quant_gemm.paths() and (large or integer != "vnni"):
            return ("bf16x3", "amx")
        if integer is None or integer == "avx2" and fmt in TILES_ON_AVX2:
            return None
        return ("int16", integer)
    if value == "float32":
        return None
    integer = value in quant_gemm.INTEGER_BITS
    path = quant_gemm.fastest_integer() if integer else quant_gemm.fastest()
    return None if path is None else (value, path)


def small_batch() -> int:
    """Rows of x up to which products stream the blocks (quant_matmul.c) and decode steps run
    their layers as one C call each (decode_layer.c): see `SMALL_BATCH`."""
    return _small_batch_for(native.library())


@functools.cache
def _small_batch_for(lib: ctypes.CDLL | None) -> int:
    if lib is None or lib.quant_kernel_isa() < 2 or quant_gemm.fastest() is not None:
        return SMALL_BATCH
    return STREAMED_BATCH


def screen_product() -> tuple[str, str] | None:
    """The product `QuantizedWeight.approximate` takes and its path: one bf16 product on AMX's
    tiles, else int8 activations on quant_gemm's fastest integer path (VNNI, else AVX2); None
    where neither is compiled. On a Zen 4 EPYC (VNNI and AVX512-BF16, no AMX), decode steps of
    128 sequences: Gemma 3's 262,144-row Q8_0 head and its candidates in 97-98 ms by int8
    against 128-136 by bf16 (a 205-208 ms step against 234-246), SmolLM2's in 23-24 against
    25-26, with 1.3x to 5x bf16's candidates. On a Zen 3 EPYC (AVX2), int8 against the float32
    tiles: Gemma 3's head at 128 rows in 352-473 ms against 467-513."""
    if "amx" in quant_gemm.paths():
        return ("bf16", "amx")
    if (path := quant_gemm.fastest_integer()) is not None:
        return ("int8", path)
    return None


def quant_matmul(
    x: torch.Tensor, blocks: torch.Tensor, fmt: Format, cols: int, activations: str = "float32"
) -> torch.Tensor:
    """x `[..., cols]` (float32, CPU) times the transposed weights stored in `blocks` (uint8
    `[rows, fmt.row_bytes(cols)]`, contiguous): `[..., rows]` float32. `activations` (an
    `activations_for` answer) picks the few-row kernel."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols).contiguous()
    lib = native.library()
    if lib is not None and x2.shape[0] <= small_batch():
        out = _small_batch(lib, x2, blocks, fmt, cols, activations)
    elif lib is not None and (gemm := gemm_path(fmt, blocks.shape[0])) is not None:
        out = quant_gemm.multiply(x2, blocks, fmt, cols, *gemm)
    else:
        out = _tiles(lib, x2, blocks, fmt, cols)
    return out.reshape(*lead, blocks.shape[0])


def _small_batch(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    cols: int,
    activations: str,
) -> torch.Tensor:
    rows = blocks.shape[0]
    out = torch.empty(x.shape[0], rows)
    kernel = getattr(lib, _KERNELS[activations])
    status = kernel(
        fmt.ggml_type, blocks.data_ptr(), rows, cols,
        x.data_ptr(), x.shape[0], torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    _check(status, fmt)
    return out


def _tiles(
    lib: ctypes.CDLL | None, x: torch.Tensor, blocks: torch.Tensor, fmt: Format, cols: int
) -> torch.Tensor:
    """x @ W.T by tiles of W dequantized to float32, each multiplied by oneDNN where torch has
    it (its kernels use AVX-512 on AMD CPUs, where MKL's sgemm, torch.mm's, does not: a Zen 5
    EPYC's SmolLM2 step, products of 128 rows, one thread, 153 ms against 309), in the row
    pieces of `_row_pieces`; by torch.mm otherwise."""
    pieces = _row_pieces(x)
    if len(pieces) == 1 and pieces[0][2] is x and 0 < blocks.shape[0] * cols <= TILE_ELEMENTS:
        ((_, weights),) = _weight_tiles(lib, blocks, fmt, cols)  # one product: the answer
        return _float32_product(x, weights)
    out = torch.empty(x.shape[0], blocks.shape[0])
    for start, weights in _weight_tiles(lib, blocks, fmt, cols):
        for first, rows, piece in pieces:
            product = _float32_product(piece, weights)[:rows]
            out[first : first + rows, start : start + weights.shape[0]] = product
    return out


def _row_pieces(x: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """x's rows as `_tiles` multiplies them, each piece as (its first row, x's rows in it, the
    piece): for oneDNN, pieces of `LARGE_PIECE_ROWS` while as many rows are left, then of
    `PIECE_ROWS` at most, each padded with zero rows to a multiple of `PIECE_MULTIPLE`; x whole
    for torch.mm."""
    n = x.shape[0]
    if not torch.backends.mkldnn.is_available() or n <= PIECE_ROWS and not n % PIECE_MULTIPLE:
        return [(0, n, x)]
    pieces = []
    first = 0
    while first < n:
        rows = LARGE_PIECE_ROWS if n - first >= LARGE_PIECE_ROWS else min(PIECE_ROWS, n - first)
        piece = x[first : first + rows]
        if padding := -rows % PIECE_MULTIPLE:
            piece = torch.cat([piece, piece.new_zeros(padding, piece.shape[1])])
        pieces.append((first, rows, piece))
        first += rows
    return pieces


def _float32_product(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x @ weights.T in float32: oneDNN's where torch has it, else torch.mm's."""
    if not torch.backends.mkldnn.is_available():
        return x @ weights.t()
    return torch.ops.mkldnn._linear_pointwise(x, weights, None, "none", [], "")


def _weight_tiles(
    lib: ctypes.CDLL | None, blocks: torch.Tensor, fmt: Format, cols: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """The float32 weights of `blocks` a tile of rows at a time, each with its first row, in
    this thread's tile buffer (each tile is gone once the next is made)."""
    rows = blocks.shape[0]
    tiles = max(1, -(-rows * cols // TILE_ELEMENTS))
    step = max(1, -(-rows // tiles))  # tiles of one size within TILE_ELEMENTS: one oneDNN shape
    tile = _tile(step, cols)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        yield start, _dequantize_into(lib, part, fmt, tile[: part.shape[0]])


_scratch = threading.local()


def _tile(rows: int, cols: int) -> torch.Tensor:
    """A float32 `[rows, cols]` view of this thread's tile buffer, kept from call to call, not
    made anew by each of a step's hundred products: its pages stay faulted in when the runner
    hands freed memory back (host_memory). SmolLM2's 128 chats, one run each: 191 -> 214
    output tokens/s; Gemma 3's 235 -> 238."""
    buffer = getattr(_scratch, "tile", None)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _scratch.tile = torch.empty(max(TILE_ELEMENTS, rows * cols))
    return buffer[: rows * cols].view(rows, cols)


def _dequantize_into(
    lib: ctypes.CDLL | None, blocks: torch.Tensor, fmt: Format, out: torch.Tensor
) -> torch.Tensor:
    """The float32 weights of `blocks` (contiguous rows), written into `out` by the C kernel;
    a new tensor by torch where the C kernels are off."""
    if lib is None:
        return dequantize(blocks, fmt, torch.float32)
    status = lib.quant_dequantize(
        fmt.ggml_type, blocks.data_ptr(), blocks.shape[0], out.shape[1],
        torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    _check(status, fmt)
    return out


def on_triton(x: torch.Tensor) -> bool:
    """Whether blocks meeting `x` are read by the Triton kernels: on CUDA, where the C kernels
    cannot read them, and wherever `PAGEDBATCH_KERNELS` chooses Triton."""
    return x.is_cuda or ops.kernels_for(x) is not ops.TORCH


def _check(status: int, fmt: Format) -> None:
    if status == -2:
        raise MemoryError("quant_matmul could not allocate its activations' scratch")
    if status != 0:
        raise ValueError(f"the C kernels do not read {fmt.name} rows of this width")


def _concat(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0]


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
        # On the CPU: quant_blocks' dequantizer makes some of its tensors there.
        picked = self.blocks[rows].cpu()
        return dequantize(picked, self.fmt, torch.float32)[(slice(None), *rest)]

    def to(self, device: torch.device) -> QuantizedTensor:
        """These blocks on `device`: a model on CUDA computes on them there."""
        if self.blocks.device == device:
            return self
        return QuantizedTensor(self.blocks.to(device), self.fmt, self.cols)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) dequantized to float32, `[*ids.shape, cols]`: an embedding
        lookup that reads only the tokens' blocks."""
        picked = self.blocks.index_select(0, ids.reshape(-1))
        if on_triton(picked):
            from pagedbatch.kernels import triton_quant

            rows = triton_quant.dequantize(picked, self.fmt, self.cols)
            return rows.reshape(*ids.shape, self.cols)
        out = torch.empty(picked.shape[0], self.cols)
        return _dequantize_into(native.library(), picked, self.fmt, out).reshape(
            *ids.shape, self.cols
        )


class QuantizedWeight:
    """A linear's weight kept in its blocks: `weight(x, bias)` is x @ W.T + bias by
    `quant_matmul`, for float32 x on the CPU, on the activations `activations_for` said for
    each format when it was made; by `triton_quant.quant_matmul` where `on_triton(x)`, in x's
    dtype. Built from the linear's parts in order (q, k and v of a fused projection, all of one
    width): consecutive parts of one format share one array of blocks, a run; a weight of several
    runs (Gemma 3's q and k in Q5_0, v in Q8_0) multiplies each and concatenates the outputs."""

    def __init__(self, runs: list[tuple[torch.Tensor, Format]], cols: int):
        self.runs = [(blocks.contiguous(), fmt) for blocks, fmt in runs]
        self.cols = cols
        self.activations = {fmt: activations_for(fmt) for _, fmt in self.runs}
        self._row_norms: torch.Tensor | None = None  # see `error_bound`
        self._int8_row_norms: torch.Tensor | None = None

    @classmethod
    def join(cls, parts: list[QuantizedTensor]) -> QuantizedWeight | None:
        """The parts' rows one after the other; None where their widths differ."""
        if any(p.cols != parts[0].cols for p in parts):
            return None
        runs: list[list[QuantizedTensor]] = []
        for part in parts:
            if runs and runs[-1][0].fmt is part.fmt:
                runs[-1].append(part)
            else:
                runs.append([part])
        # A lone part's blocks are shared, not copied: a tied LM head's are the embedding's.
        joined = [(_concat([p.blocks for p in run]), run[0].fmt) for run in runs]
        return cls(joined, parts[0].cols)

    @property
    def formats(self) -> tuple[Format, ...]:
        return tuple(fmt for _, fmt in self.runs)

    def output_rows(self, part: slice) -> QuantizedWeight:
        """The weight of the outputs `part` selects (a step of 1): views of the blocks, whose
        rows are the outputs', so nothing is copied."""
        start, stop, _ = part.indices(self.rows)
        runs, first = [], 0
        for blocks, fmt in self.runs:
            lo, hi = max(start - first, 0), min(stop - first, blocks.shape[0])
            if lo < hi:
                runs.append((blocks[lo:hi], fmt))
            first += blocks.shape[0]
        sliced = copy.copy(self)
        sliced.runs = runs
        sliced._row_norms = sliced._int8_row_norms = None
        return sliced

    @property
    def rows(self) -> int:
        return sum(blocks.shape[0] for blocks, _ in self.runs)

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for blocks, _ in self.runs)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if on_triton(x):
            from pagedbatch.kernels import triton_quant

            outs = [triton_quant.quant_matmul(x, b, fmt, self.cols) for b, fmt in self.runs]
        else:
            outs = [
                quant_matmul(x, b, fmt, self.cols, self.activations[fmt]) for b, fmt in self.runs
            ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out.add_(bias)

    def approximates(self, x: torch.Tensor) -> bool:
        """Whether `approximate` runs here for x and costs less than the product: one run of
        blocks, x on the C kernels' path with more rows than `small_batch()` or `SCREEN_BATCH`
        (fewer stream the blocks once, bound by reading them), a `screen_product`."""
        return (
            len(self.runs) == 1
            and x.shape[0] > min(small_batch(), SCREEN_BATCH)
            and x.dtype == torch.float32
            and not on_triton(x)
            and screen_product() is not None
        )

    def approximate(
        self, x: torch.Tensor, part: slice, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The outputs `part` selects of x @ W.T (x float32 `[n, cols]` on the CPU) by the
        `screen_product` (one bf16 product on AMX, a third of bf16x3's time; else int8
        activations), `[n, width]` (written
        into `out` where given, contiguous float32 of that shape); within `error_bound` of any
        float32 product's."""
        ((blocks, fmt),) = self.runs
        start, stop, _ = part.indices(self.rows)
        screen = screen_product()
        assert screen is not None, "approximate where approximates() says it runs"
        return quant_gemm.multiply(x.contiguous(), blocks[start:stop], fmt, self.cols, *screen, out)

    def error_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(margin `[n]`, norms `[rows]`): |approximate(x)[i, j] - (x @ W.T)[i, j]| is at most
        margin[i] * norms[j], where x @ W.T is any float32 product's, whose float32 sums in
        any order err by at most 2 cols 2^-24 of sum |x w| <= ||x|| ||w|| (Cauchy-Schwarz; each
        weight row's norm computed once, rounded up).

        bf16: each product of bf16-rounded x and w is within 2^-7 + 2^-16 of x w, and its float32
        sums err as the exact path's. The small constant added covers bf16's flush of
        subnormals.

        int8: the approximation is the exact weights times x', x quantized per block (its error
        e = ||x - x'|| measured, at most ||w|| e), then float32's roundings: each output a sum
        of at most 2 G terms (G groups: an integer sum times a scale, and where the format has
        offsets of its own, Q4_1's and the K formats' mins, an offset times the activations'
        sum), each within 2^-23 of itself, together at most (||w|| + 2 ||m||) ||x'|| (w = s q + m
        for each weight, so |s q| <= |w| + |m|; m those offsets, `quant_gemm.offset_norms`, 0
        for the formats whose offset starts the integer sum), and summed in order: (2 G + 3)
        2^-24 of that. With norms max(||w||, (||w|| + 2 ||m||) / 64) the whole is within margin
        times norms."""
        x_norms = torch.linalg.vector_norm(x, dim=1).mul_(1 + 2**-10)
        exact_sums = 2 * self.cols * 2**-24
        screen = screen_product()
        if screen is None or screen[0] == "bf16":
            margin = x_norms.mul_((2**-7 + 2**-16 + exact_sums) * (1 + 2**-10))
            return margin.add_(SUBNORMAL_SLACK), self._norms()
        ((_, fmt),) = self.runs
        error = quant_gemm.quantization_error(x.contiguous(), fmt, 8, screen[1])
        terms = 2 * (self.cols // 16) + 3  # G at most cols / 16 (Q6_K's groups)
        roundings = 64 * terms * 2**-24 * (1 + 2**-10)
        margin = error + exact_sums * x_norms + roundings * (x_norms + error)
        return margin.mul_(1 + 2**-10).add_(SUBNORMAL_SLACK), self._int8_norms()

    def rows_product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x @ W[ids].T in float32 (`[n, len(ids)]`), the rows `ids` (int64) dequantized a tile
        at a time."""
        ((blocks, fmt),) = self.runs
        out = torch.empty(x.shape[0], len(ids))
        picked = blocks.index_select(0, ids)
        # torch.mm: a step's candidates are a new count of rows each time, and oneDNN would keep
        # a primitive for each (see PIECE_ROWS).
        for start, weights in _weight_tiles(native.library(), picked, fmt, self.cols):
            out[:, start : start + weights.shape[0]] = x @ weights.T
        return out

    def _norms(self) -> torch.Tensor:
        """Each output row's float32 weights' Euclidean norm, rounded up (see `error_bound`),
        computed on first use a tile at a time."""
        if self._row_norms is None:
            ((blocks, fmt),) = self.runs
            norms = torch.empty(self.rows)
            for start, weights in _weight_tiles(native.library(), blocks, fmt, self.cols):
                norms[start : start + weights.shape[0]] = torch.linalg.vector_norm(weights, dim=1)
            self._row_norms = norms.mul_(1 + 2**-10).add_(SUBNORMAL_SLACK)
        return self._row_norms

    def _int8_norms(self) -> torch.Tensor:
        """max(||w||, (||w|| + 2 ||m||) / 64) for each output row, rounded up (see
        `error_bound`), computed on first use."""
        if self._int8_row_norms is None:
            ((blocks, fmt),) = self.runs
            offsets = quant_gemm.offset_norms(blocks, fmt, self.cols, 8)
            split = offsets.mul_(2).add_(self._norms()).mul_((1 + 2**-10) / 64)
            self._int8_row_norms = torch.maximum(self._norms(), split)
        return self._int8_row_norms
