"""The many-row product with block-quantized weights (`quant_gemm.c`): its build, beside the other
C kernels' (`native`), and its call.

`quant_gemm.c` is a library of its own: its AMX path needs the tile state that Linux grants a
process on request, and its source changes apart from `quant_matmul.c`'s. Built and loaded as
`native` builds the others (on first use, `-march=native`, into the user's cache; None with a
warning where it cannot be built, and off with `PAGEDBATCH_NATIVE_KERNELS=0`).

Its paths (`paths()`), each splitting the weights and activations into bfloat16 parts and
summing their products in float32: three products a weight and activation (bf16x3, float32's
accuracy near enough) or one (bf16); the bounds are in quant_gemm.c.
- amx: Intel AMX-BF16 tiles (Sapphire Rapids and later), where Linux grants the tile state;
- avx512: AVX512-BF16's vdpbf16ps (Zen 4, Cooper Lake and later);
- portable: plain C, for checking the other two anywhere; quant_linear does not take it.

And integer activations (`quant_gemm_int`): x quantized per block of 32 to int16 or int8, each
weight its stored integer with its group's scale and offset, integer sums (`integer_paths()`):
- vnni: AVX512-VNNI's vpdpwssd (int16) and vpdpbusd (int8) (Zen 4, Ice Lake and later);
- avx2: vpmaddwd (int16), vpmaddubsw then vpmaddwd (int8), on any AVX2 CPU;
- portable: plain C, the same arithmetic to the bit.
int16 (32 products an instruction, each activation within 2^-16 of its block's largest) is
quant_linear's default on VNNI CPUs (with AMX too, but for large Q4/Q8 weights: `gemm_path`);
int8 (llama.cpp's arithmetic; 63 levels against Q8_0, `levels`) the LM head's screen where no
bf16 path runs (`QuantizedWeight`), and for the layers only where `PAGEDBATCH_QUANT_GEMM=int8`
asks: SmolLM2's greedy answers with it failed the quality gate (benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedbatch.kernels import native
from pagedbatch.kernels.quant_blocks import Format

SOURCE = Path(__file__).with_name("quant_gemm.c")
# The paths by the number quant_gemm.c knows them by, fastest last.
PATHS = {"portable": 0, "avx512": 1, "amx": 2}
INTEGER_PATHS = {"portable": 0, "vnni": 1, "avx2": 2}
# The products a setting names: bf16 products a weight (3 or 1), or integer activations of as
# many bits (`INTEGER_BITS`).
PRODUCTS = ("bf16x3", "bf16", "int16", "int8")
PASSES = {"bf16x3": 3, "bf16": 1}
INTEGER_BITS = {"int16": 16, "int8": 8}

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
SIGNATURES: dict[str, list[type]] = {
    "quant_gemm": [
        _i32, _ptr, _i64, _i64,  # ggml type, blocks, rows, cols
        _ptr, _i64, _i32, _i32, _i32, _ptr,  # x, its rows, path, passes, threads, out
    ],
    "quant_gemm_paths": [],
    "quant_gemm_int": [
        _i32, _ptr, _i64, _i64,  # ggml type, blocks, rows, cols
        _ptr, _i64, _i32, _i32, _i32, _ptr,  # x, its rows, bits, path, threads, out
    ],
    "quant_gemm_int_paths": [],
    "quant_gemm_int_levels": [_i32, _i32, _i32],  # ggml type, bits, path
    # type, bits, path, x, n, cols, out
    "quant_gemm_int_error": [_i32, _i32, _i32, _ptr, _i64, _i64, _ptr],
    "quant_gemm_int_offset_norms": [
        _i32, _i32, _ptr, _i64, _i64, _ptr,  # ggml type, bits, blocks, rows, cols, out
    ],
}  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    """quant_gemm.c built and loaded on first call; None where it cannot be (logged once)."""
    return native.load(
        (SOURCE,), "quant_gemm", SIGNATURES, "quant_gemm.c", "quantized prefill takes tiles"
    )


@functools.cache
def paths() -> frozenset[str]:
    """The paths compiled for this CPU and permitted here (none without the library)."""
    lib = library()
    if lib is None:
        return frozenset()
    mask = lib.quant_gemm_paths()
    return frozenset(name for name, bit in PATHS.items() if mask >> bit & 1)


@functools.cache
def integer_paths() -> frozenset[str]:
    """The integer paths compiled for this CPU (none without the library)."""
    lib = library()
    if lib is None:
        return frozenset()
    mask = lib.quant_gemm_int_paths()
    return frozenset(name for name, bit in INTEGER_PATHS.items() if mask >> bit & 1)


def fastest() -> str | None:
    """amx, else avx512, where one runs here: the bf16 path for `PAGEDBATCH_QUANT_GEMM=bf16x3`
    or `bf16` (by default quant_linear takes amx alone: see quant_linear.gemm_path)."""
    return next((p for p in ("amx", "avx512") if p in paths()), None)


def fastest_integer() -> str | None:
    """vnni, else avx2, where one is compiled here: the integer products' path."""
    return next((p for p in ("vnni", "avx2") if p in integer_paths()), None)


def quant_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    cols: int,
    path: str,
    passes: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x `[n, cols]` (float32, contiguous) times the transposed weights in `blocks` (uint8
    `[rows, fmt.row_bytes(cols)]`, contiguous) by `path`, in `passes` bf16 products (3: bf16x3,
    float32's accuracy; 1: bf16): `[n, rows]` float32, written into `out` where given (a
    contiguous float32 tensor of that shape)."""
    lib = library()
    if lib is None or path not in paths():
        raise RuntimeError(f"quant_gemm's {path} path does not run here")
    out = _output(x, blocks, out)
    status = lib.quant_gemm(
        fmt.ggml_type, blocks.data_ptr(), blocks.shape[0], cols,
        x.data_ptr(), x.shape[0], PATHS[path], passes, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("quant_gemm could not allocate its buffers")
    if status != 0:
        raise ValueError(f"quant_gemm does not read {fmt.name} rows of {cols} ({path}: {status})")
    return out


def _output(x: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The product's `[n, rows]` float32 output: `out` where given, checked, else a new one."""
    shape = (x.shape[0], blocks.shape[0])
    if out is None:
        return torch.empty(shape)
    if out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {list(shape)}, not {out.shape}")
    return out


def quant_gemm_int(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    cols: int,
    bits: int,
    path: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `quant_gemm`, with x quantized per block of 32 to `bits` (16 or 8; at most `levels`)
    and integer products by `path` (an `INTEGER_PATHS` name): `[n, rows]` float32, written into
    `out` where given."""
    lib = library()
    if lib is None or path not in integer_paths():
        raise RuntimeError(f"quant_gemm's integer {path} path does not run here")
    out = _output(x, blocks, out)
    status = lib.quant_gemm_int(
        fmt.ggml_type, blocks.data_ptr(), blocks.shape[0], cols,
        x.data_ptr(), x.shape[0], bits, INTEGER_PATHS[path], torch.get_num_threads(),
        out.data_ptr(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("quant_gemm_int could not allocate its buffers")
    if status != 0:
        raise ValueError(
            f"quant_gemm_int does not read {fmt.name} rows of {cols} as int{bits} ({status})"
        )
    return out


def _built() -> ctypes.CDLL:
    """The library, for the calls that every build has; raises where it is not built."""
    lib = library()
    if lib is None:
        raise RuntimeError("quant_gemm.c is not built here")
    return lib


def levels(fmt: Format, bits: int, path: str) -> int:
    """The largest integer `quant_gemm_int` quantizes activations to against `fmt` on `path`
    (32767 for int16; 127 for int8, but 63 against Q8_0 on AVX2)."""
    return int(_built().quant_gemm_int_levels(fmt.ggml_type, bits, INTEGER_PATHS[path]))


def quantization_error(x: torch.Tensor, fmt: Format, bits: int, path: str) -> torch.Tensor:
    """Each row's ||x - x'|| (`[n]` float32, rounded up), x' the activations `quant_gemm_int`
    multiplies in place of x (float32, contiguous) against `fmt` with `bits` on `path`."""
    out = torch.empty(x.shape[0])
    status = _built().quant_gemm_int_error(
        fmt.ggml_type, bits, INTEGER_PATHS[path], x.data_ptr(), x.shape[0], x.shape[1],
        out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"quant_gemm_int does not read {fmt.name} rows of {x.shape[1]}")
    return out


def offset_norms(blocks: torch.Tensor, fmt: Format, cols: int, bits: int) -> torch.Tensor:
    """Each weight row's offsets' 2-norm as `quant_gemm_int` takes them (`[rows]` float32,
    rounded up; zeros for the formats whose offset is a multiple of the scale, which it keeps
    out of the float terms): the float32 roundings of its outputs are bounded by these as well
    as by the weights' norms."""
    out = torch.empty(blocks.shape[0])
    status = _built().quant_gemm_int_offset_norms(
        fmt.ggml_type, bits, blocks.data_ptr(), blocks.shape[0], cols, out.data_ptr()
    )
    if status != 0:
        raise ValueError(f"quant_gemm_int does not read {fmt.name} rows of {cols}")
    return out


def multiply(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    cols: int,
    product: str,
    path: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T by `product` (see `PRODUCTS`) on `path` (one of `paths()` for the bf16 products,
    of `integer_paths()` for int16 and int8), written into `out` where given."""
    if product in INTEGER_BITS:
        return quant_gemm_int(x, blocks, fmt, cols, INTEGER_BITS[product], path, out)
    return quant_gemm(x, blocks, fmt, cols, path, PASSES[product], out)


def entry(product: str, path: str) -> tuple[int, int, int]:
    """`multiply`'s C function for `product` on `path`, as C calls it: its address and its two
    settings (quant_gemm's path and passes, quant_gemm_int's bits and path), which the two
    functions take in the same place."""
    lib = _built()
    if product in INTEGER_BITS:
        function, settings = lib.quant_gemm_int, (INTEGER_BITS[product], INTEGER_PATHS[path])
    else:
        function, settings = lib.quant_gemm, (PATHS[path], PASSES[product])
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address, *settings
