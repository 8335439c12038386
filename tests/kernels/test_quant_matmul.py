"""The quantized-weight matmul kernels (`quant_matmul.c` through `quant_linear`) against the
float64 reference: x @ dequantize(blocks).T.

The float path and the tiles' path multiply the exact weights with x as it is: float32's
rounding is their whole error. The int8 path quantizes each block of 32 activations to a scale
amax / 127 and int8 quants, so an activation moves by at most amax / 254, and an output by at
most the sum over its blocks of amax / 254 times the block's sum of |w|: that is its bound
(with float32's rounding on top). The int16 path likewise, to amax / 32767: amax / 65534.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from itertools import accumulate

import numpy as np
import pytest
import torch
from test_quant_blocks import random_blocks

from pagedbatch.kernels import few_row_activations, native, quant_linear
from pagedbatch.kernels.quant_blocks import BLOCK, Format, dequantize

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

INT8 = sorted(quant_linear.INT8_FORMATS, key=lambda f: f.ggml_type)
# SmolLM2-135M's linears (hidden 576, intermediate 1536), Gemma 3 270M's K-format ones (640 rows
# of 1024 and 2048), odd sizes: a lone block, tails.
ROW_SHAPES = {
    32: [(1, 576), (3, 576), (17, 1536), (300, 576), (1536, 576), (576, 1536), (5, 32), (7, 96)],
    256: [(1, 256), (3, 1024), (17, 2048), (640, 1024), (640, 2048), (5, 512)],
}


def with_shapes(formats: list[Format]) -> list[tuple[Format, int, int]]:
    return [(f, rows, cols) for f in formats for rows, cols in ROW_SHAPES[f.size]]


def rounding_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32's rounding of sums of a few hundred products, per output `[n, rows]`."""
    return 1e-5 * (x.double().abs() @ weights.abs().T) + 1e-6


def activation_bound(x: torch.Tensor, weights: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """Per output, the most activations quantized per block to integers of +-`levels` (int8's
    127, int16's 32767) can move it: sum over blocks of amax / (2 levels) times sum |w|
    (`[n, rows]`), plus float32's rounding of the sums."""
    n, rows = x.shape[0], weights.shape[0]
    amax = x.double().abs().reshape(n, -1, BLOCK).amax(-1)  # [n, blocks]
    w_abs = weights.abs().reshape(rows, -1, BLOCK).sum(-1)  # [rows, blocks]
    return (amax / (2 * levels)) @ w_abs.T * 1.001 + rounding_bound(x, weights)


def build_portable(tmp_path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """quant_matmul.c built for no particular CPU: the portable path (on x86-64, SSE2 only); or,
    with `extra_flags`, for what they say."""
    target = tmp_path / f"quant_portable{'-'.join(extra_flags)}.so"
    flags = [f for f in native.FLAGS if f != "-march=native"] + list(extra_flags)
    compiler = shutil.which("cc") or shutil.which("gcc")
    source = next(str(s) for s in native.SOURCES if s.name == "quant_matmul.c")
    subprocess.run([compiler, *flags, source, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    names = ("quant_matmul_float", "quant_matmul_int8", "quant_matmul_int16", "quant_dequantize")
    for name in (*names, "quant_kernel_isa", "quant_float_streamed", "quant_int16_streamed"):
        getattr(lib, name).argtypes = native.SIGNATURES[name]
        getattr(lib, name).restype = ctypes.c_int
    return lib


# The CPU's AVX2 path without its AVX-512 one, where it has both: each is checked.
AVX2_ONLY = ("-march=native", "-mno-avx512f")


@pytest.fixture(scope="module", params=["native", "portable", "avx2"])
def lib(request, tmp_path_factory) -> ctypes.CDLL:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    if request.param == "portable":
        return build_portable(tmp_path_factory.mktemp("portable"))
    if request.param == "avx2":
        if "avx512f" not in native.cpu_flags():
            pytest.skip("native is the AVX2 path already")
        return build_portable(tmp_path_factory.mktemp("avx2"), AVX2_ONLY)
    native.library.cache_clear()
    built = native.library()
    assert built is not None, "the C kernels did not build; see the warning"
    return built


def run_small(
    lib: ctypes.CDLL, blocks: np.ndarray, fmt: Format, x: torch.Tensor, activations: str = "int8"
) -> torch.Tensor:
    stored = torch.from_numpy(blocks)
    return quant_linear._small_batch(lib, x, stored, fmt, x.shape[1], activations)


def with_outliers(n: int, cols: int) -> torch.Tensor:
    """Activations as a model's hidden states are: mostly small, a few features 30 times more."""
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    x[:, 5::97] *= 30
    return x


@pytest.mark.parametrize(("fmt", "rows", "cols"), with_shapes(INT8), ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_int8_path_within_the_activation_bound(lib, fmt, rows, cols, n):
    blocks = random_blocks(fmt, rows, cols, seed=rows + n)
    x = with_outliers(n, cols)
    weights = dequantize(blocks, fmt)
    exact = x.double() @ weights.T
    out = run_small(lib, blocks, fmt, x)
    assert (out.double() - exact).abs().le(activation_bound(x, weights)).all()


@pytest.mark.parametrize(("fmt", "rows", "cols"), with_shapes(list(Format)), ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_float_path_within_float32_rounding(lib, fmt, rows, cols, n):
    blocks = random_blocks(fmt, rows, cols, seed=rows + n)
    x = with_outliers(n, cols)
    weights = dequantize(blocks, fmt)
    out = run_small(lib, blocks, fmt, x, "float32")
    assert (out.double() - x.double() @ weights.T).abs().le(rounding_bound(x, weights)).all()


@pytest.mark.parametrize(("fmt", "rows", "cols"), with_shapes(list(Format)), ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_int16_path_within_its_activation_bound_where_it_streams(lib, fmt, rows, cols, n):
    """Where it is compiled (AVX2 and AVX-512) it reads every format the float path streams;
    elsewhere it refuses them all."""
    blocks = random_blocks(fmt, rows, cols, seed=rows + n)
    x = with_outliers(n, cols)
    if not lib.quant_int16_streamed(fmt.ggml_type):
        assert lib.quant_kernel_isa() == 0 or not lib.quant_float_streamed(fmt.ggml_type)
        with pytest.raises(ValueError, match="do not read"):
            run_small(lib, blocks, fmt, x, "int16")
        return
    weights = dequantize(blocks, fmt)
    out = run_small(lib, blocks, fmt, x, "int16")
    bound = activation_bound(x, weights, levels=32767)
    assert (out.double() - x.double() @ weights.T).abs().le(bound).all()


@pytest.mark.parametrize("fmt", INT8, ids=lambda f: f.name)
def test_int8_path_sums_exactly_what_it_quantized(lib, fmt):
    """With activations the int8 grid holds exactly (each block's amax 127, integers), the int8
    path's only error is float32 rounding: the integer sums themselves are exact."""
    rows, cols = 17, 576 if fmt.size == BLOCK else 512
    blocks = random_blocks(fmt, rows, cols, seed=5)
    ints = torch.randint(-127, 128, (3, cols), generator=torch.Generator().manual_seed(0))
    ints.view(3, -1, BLOCK)[..., 0] = 127
    x = ints.float()
    exact = x.double() @ dequantize(blocks, fmt).T
    out = run_small(lib, blocks, fmt, x).double()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activations", ["int8", "int16", "float32"])
def test_the_vocabulary_projection(lib, activations):
    """SmolLM2's tied LM head: Q8_0, 49152 x 576, one decode row."""
    if activations == "int16" and not lib.quant_int16_streamed(Format.Q8_0.ggml_type):
        pytest.skip("no int16 path in this build")
    blocks = random_blocks(Format.Q8_0, 49152, 576, seed=9)
    x = with_outliers(1, 576)
    weights = dequantize(blocks, Format.Q8_0)
    out = run_small(lib, blocks, Format.Q8_0, x, activations).double()
    bound = {
        "int8": activation_bound(x, weights),
        "int16": activation_bound(x, weights, levels=32767),
        "float32": rounding_bound(x, weights),
    }[activations]
    assert (out - x.double() @ weights.T).abs().le(bound).all()


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_dequantize_kernel_is_exact(lib, fmt):
    rows, cols = 300, 2048
    blocks = random_blocks(fmt, rows, cols, seed=3)
    out = torch.empty(rows, cols)
    stored = torch.from_numpy(blocks)
    assert (
        lib.quant_dequantize(fmt.ggml_type, stored.data_ptr(), rows, cols, 2, out.data_ptr()) == 0
    )
    # Each weight's exact value rounded once to float32 (see quant_matmul.c's dequantize_block).
    torch.testing.assert_close(out.double(), dequantize(blocks, fmt), rtol=2**-24, atol=0)


def test_what_the_kernels_do_not_read_is_refused(lib):
    out, x = torch.empty(4), torch.zeros(40)
    blocks = torch.zeros(2, 100, dtype=torch.uint8)
    for kernel in (lib.quant_matmul_int8, lib.quant_matmul_float, lib.quant_matmul_int16):
        assert kernel(10, blocks.data_ptr(), 2, 32, x.data_ptr(), 1, 1, out.data_ptr()) == -1
        assert kernel(3, blocks.data_ptr(), 2, 40, x.data_ptr(), 1, 1, out.data_ptr()) == -1
        assert kernel(12, blocks.data_ptr(), 2, 32, x.data_ptr(), 1, 1, out.data_ptr()) == -1
    q5_k = Format.Q5_K.ggml_type  # neither integer path reads Q5_K
    assert lib.quant_matmul_int8(q5_k, blocks.data_ptr(), 1, 256, x.data_ptr(), 1, 1, 0) == -1
    assert lib.quant_matmul_int16(q5_k, blocks.data_ptr(), 1, 256, x.data_ptr(), 1, 1, 0) == -1
    assert lib.quant_dequantize(10, blocks.data_ptr(), 2, 256, 1, out.data_ptr()) == -1


@needs_compiler
def test_the_native_build_takes_avx512_or_avx2_where_the_cpu_has_it(tmp_path):
    native.library.cache_clear()
    lib = native.library()
    assert lib is not None
    flags = native.cpu_flags()
    has_avx2 = {"avx2", "fma", "f16c"} <= flags
    has_avx512 = has_avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"} <= flags
    assert lib.quant_kernel_isa() == (3 if has_avx512 else 2 if has_avx2 else 0)
    assert build_portable(tmp_path).quant_kernel_isa() == 0
    if has_avx512:
        assert build_portable(tmp_path, AVX2_ONLY).quant_kernel_isa() == 2


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 9, 40, 150])
@pytest.mark.parametrize("setting", ["int8", "int16", "float32"])
def test_quant_matmul_on_every_path(fmt, n, setting, monkeypatch):
    """Through `quant_matmul` as the model calls it, on the activations the setting gives the
    format: leading dimensions kept, a streaming path for a few rows, tiles beyond (here 3 tiles
    of 101 rows and one of 98; 150 rows of x, two padded pieces), and torch's dequantizer where
    the C kernels are off."""
    monkeypatch.setattr(quant_linear, "TILE_ELEMENTS", 128 * 1024)
    # Past a few rows the tiles, not quant_gemm.c's bf16 paths (test_quant_gemm.py checks those).
    monkeypatch.setenv(quant_linear.GEMM_SETTING, "float32")
    monkeypatch.setenv(quant_linear.ACTIVATIONS_SETTING, setting)
    activations = quant_linear.activations_for(fmt)
    rows, cols = 401, 1024
    blocks = random_blocks(fmt, rows, cols, seed=n)
    x = torch.randn(n, 1, cols, generator=torch.Generator().manual_seed(n))
    weights = dequantize(blocks, fmt)
    out = quant_linear.quant_matmul(x, torch.from_numpy(blocks), fmt, cols, activations)
    assert out.shape == (n, 1, rows) and out.dtype == torch.float32
    error = (out.reshape(n, rows).double() - x.reshape(n, cols).double() @ weights.T).abs()
    levels = {"int8": 127, "int16": 32767}.get(activations)
    if levels is None or n > quant_linear.small_batch():
        bound = rounding_bound(x.reshape(n, cols), weights)
    else:
        bound = activation_bound(x.reshape(n, cols), weights, levels)
    assert error.le(bound).all()


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize(("n", "rows"), [(0, 100), (40, 0), (200, 0)])
def test_no_rows_of_x_or_of_weights_give_an_empty_product(n, rows, monkeypatch):
    monkeypatch.setenv(quant_linear.GEMM_SETTING, "float32")
    blocks = torch.from_numpy(random_blocks(Format.Q4_1, 100, 64, seed=0))[:rows]
    out = quant_linear.quant_matmul(torch.ones(n, 64), blocks, Format.Q4_1, 64)
    assert out.shape == (n, rows)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch has no oneDNN")
def test_the_tiles_give_onednn_a_few_shapes_of_x_whatever_its_rows():
    """oneDNN keeps a compiled primitive for each shape it multiplies: x's rows reach it in
    pieces of LARGE_PIECE_ROWS, else of at most PIECE_ROWS padded to a multiple of
    PIECE_MULTIPLE, x's rows in order, each followed by zeros."""
    shapes = set()
    for n in [*range(1, 300), 511, 512, 513, 1100, 2048]:
        x = torch.arange(1.0, n + 1).view(n, 1)
        pieces = quant_linear._row_pieces(x)
        assert torch.equal(torch.cat([piece[:rows] for _, rows, piece in pieces]), x)
        assert [first for first, _, _ in pieces] == [0, *accumulate(r for _, r, _ in pieces)][:-1]
        assert not any(piece[rows:].any() for _, rows, piece in pieces)
        shapes |= {piece.shape[0] for _, _, piece in pieces}
    multiple, most = quant_linear.PIECE_MULTIPLE, quant_linear.PIECE_ROWS
    assert shapes == {*range(multiple, most + 1, multiple), quant_linear.LARGE_PIECE_ROWS}


@needs_compiler
def test_each_setting_gives_each_format_the_activations_its_kernels_read(monkeypatch, tmp_path):
    """`auto`: where the C kernels stream the format both ways (AVX2, AVX-512), int16 or float32
    as measured on this CPU (test_few_row_activations.py); in the portable build float32, but int8
    for the K formats, whose float path would dequantize each row first. `int16`, `int8` and
    `float32` where their kernel reads the format, else float32."""
    lib = native.library()
    assert lib is not None
    portable = build_portable(tmp_path)
    assert not any(portable.quant_int16_streamed(f.ggml_type) for f in Format)
    assert not any(portable.quant_float_streamed(f.ggml_type) for f in quant_linear.INT8_BY_DEFAULT)
    streams = lib.quant_kernel_isa() >= 2
    int16 = {f for f in Format if lib.quant_int16_streamed(f.ggml_type)}
    assert int16 == (set(Format) - {Format.Q5_K} if streams else set())

    def chosen(setting: str) -> dict[Format, str]:
        monkeypatch.setenv(quant_linear.ACTIVATIONS_SETTING, setting)
        return {f: quant_linear.activations_for(f) for f in Format}

    fallback = {f: "int8" if f in quant_linear.INT8_BY_DEFAULT else "float32" for f in Format}
    measured = few_row_activations.chosen(lib)
    assert set(measured) == int16
    assert chosen("auto") == {f: measured.get(f, fallback[f]) for f in Format}
    assert chosen("int16") == {f: "int16" if f in int16 else "float32" for f in Format}
    assert chosen("int8") == {
        f: "int8" if f in quant_linear.INT8_FORMATS else "float32" for f in Format
    }
    assert set(chosen("float32").values()) == {"float32"}
    monkeypatch.setenv(quant_linear.ACTIVATIONS_SETTING, "int4")
    with pytest.raises(ValueError, match="auto, float32, int16 or int8"):
        quant_linear.activations_for(Format.Q8_0)
    monkeypatch.setenv(quant_linear.ACTIVATIONS_SETTING, "auto")
    blocks = torch.from_numpy(random_blocks(Format.Q8_0, 4, 32))
    weight = quant_linear.QuantizedWeight([(blocks, Format.Q8_0)], 32)
    assert weight.activations == {Format.Q8_0: chosen("auto")[Format.Q8_0]}


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_an_embedding_lookup_dequantizes_just_its_rows(fmt):
    blocks = random_blocks(fmt, 50, 256, seed=4)
    table = quant_linear.QuantizedTensor(torch.from_numpy(blocks), fmt, 256)
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]])
    rows = table.take_rows(ids)
    assert rows.shape == (2, 3, 256) and rows.dtype == torch.float32
    expected = dequantize(blocks, fmt)[ids]
    torch.testing.assert_close(rows.double(), expected, rtol=2**-24, atol=0)


def test_a_slice_of_a_weights_outputs_multiplies_as_those_columns_of_the_whole():
    """`output_rows` cuts across runs (q in Q4_0, k and v in Q8_0 here), copying nothing."""
    parts = [(Format.Q4_0, 96), (Format.Q8_0, 64)]
    runs = [(torch.from_numpy(random_blocks(f, n, 64, seed=n)), f) for f, n in parts]
    weight = quant_linear.QuantizedWeight(runs, 64)
    storages = {blocks.untyped_storage().data_ptr() for blocks, _ in weight.runs}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    whole = weight(x)
    for part in (slice(0, 96), slice(40, 130), slice(100, 160), slice(150, None)):
        sliced = weight.output_rows(part)
        assert sliced.rows == len(range(160)[part])
        assert {b.untyped_storage().data_ptr() for b, _ in sliced.runs} <= storages
        # Each output is its own row's sum: the same whichever outputs are computed beside it.
        torch.testing.assert_close(sliced(x), whole[:, part], rtol=0, atol=0)
