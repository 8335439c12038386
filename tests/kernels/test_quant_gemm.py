"""The many-row quantized product (`quant_gemm.c`) on each of its paths against the float64
reference x @ dequantize(blocks).T, and `quant_linear`'s choice of it.

Each path rounds weights and activations to bfloat16 parts and sums their products in float32.
One part (bf16): a weight and an activation each move by at most 2^-8 of themselves, so an output
by at most ~2^-7 of sum |x w| (the bound below allows 1.01 x that, plus float32's rounding).
Three products of two parts (bf16x3): each moves by at most 2^-16 of itself, an output by under
2^-14 of sum |x w|.
int16 and int8 (x quantized per block of 32, integer products): the exact weights times the
quantized activations, so an output moves by at most sum over blocks of amax / (2 L) times
sum |w| (L = `quant_gemm.levels`: 32767, or 127 and 63 against Q8_0: `activation_bound`,
quant_matmul.c's bound).
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import pytest
import torch
from test_quant_blocks import random_blocks
from test_quant_matmul import activation_bound, rounding_bound, with_outliers

from pagedbatch.kernels import native, quant_gemm, quant_linear
from pagedbatch.kernels.quant_blocks import Format, dequantize

PASSES_BOUND = {1: 2**-7 * 1.01, 3: 2**-14}
# SmolLM2-135M's linears (576 wide: q/k/v 960 rows, gate/up 3072, LM head; 1536 wide: down)
# and Gemma 3 270M's K-format ones (1024 and 2048 wide), cut to a few panels; odd row counts (a
# partial panel of 32) and lone blocks.
ROW_SHAPES = {
    32: [(960, 576), (97, 1536), (33, 576), (5, 32), (31, 96)],
    256: [(65, 1024), (40, 2048), (7, 256)],
}
# Rows of x: past quant_linear's small batch, odd ones (AMX's blocks of 32 partly empty), a chunk
# of 256 and a ragged second one.
X_ROWS = [9, 13, 32, 45, 300]


@pytest.fixture(scope="module", autouse=True)
def built():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    quant_gemm.library.cache_clear()
    quant_gemm.paths.cache_clear()
    quant_gemm.integer_paths.cache_clear()
    assert quant_gemm.library() is not None, "quant_gemm.c did not build; see the warning"


def shapes() -> list[tuple[Format, int, int]]:
    return [(f, rows, cols) for f in Format for rows, cols in ROW_SHAPES[f.size]]


def error_within(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, passes: int) -> bool:
    exact = x.double() @ weights.T
    bound = PASSES_BOUND[passes] * (x.double().abs() @ weights.abs().T) + rounding_bound(x, weights)
    return bool((out.double() - exact).abs().le(bound).all())


@pytest.mark.parametrize("path", sorted(quant_gemm.PATHS))
@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize(("fmt", "rows", "cols"), shapes(), ids=str)
def test_every_path_within_its_bound(path, passes, fmt, rows, cols):
    if path not in quant_gemm.paths():
        pytest.skip(f"this CPU runs no {path} path")
    blocks = random_blocks(fmt, rows, cols, seed=rows)
    weights = dequantize(blocks, fmt)
    for n in X_ROWS if path != "portable" else X_ROWS[:2]:
        x = with_outliers(n, cols)
        out = quant_gemm.quant_gemm(x, torch.from_numpy(blocks), fmt, cols, path, passes)
        assert out.shape == (n, rows)
        assert error_within(out, x, weights, passes), (n, path)


def test_the_paths_agree_with_the_portable_one():
    """Every path rounds the same parts: their outputs differ by float32's summing order only."""
    fmt, rows, cols = Format.Q4_1, 70, 576
    blocks = torch.from_numpy(random_blocks(fmt, rows, cols, seed=2))
    x = with_outliers(40, cols)
    weights = dequantize(blocks, fmt)
    for passes in (1, 3):
        reference = quant_gemm.quant_gemm(x, blocks, fmt, cols, "portable", passes).double()
        for path in quant_gemm.paths():
            out = quant_gemm.quant_gemm(x, blocks, fmt, cols, path, passes).double()
            assert (out - reference).abs().le(rounding_bound(x, weights)).all(), (path, passes)


def test_the_vocabulary_projection_in_one_call():
    """SmolLM2's tied LM head (Q8_0, 49152 x 576) for 130 rows: 1536 panels, split among the
    threads."""
    blocks = torch.from_numpy(random_blocks(Format.Q8_0, 49152, 576, seed=9))
    x = with_outliers(130, 576)
    path = quant_gemm.fastest() or "portable"
    out = quant_gemm.quant_gemm(x, blocks, Format.Q8_0, 576, path)
    assert error_within(out, x, dequantize(blocks, Format.Q8_0), 3)


def test_what_it_does_not_read_is_refused():
    lib = quant_gemm.library()
    out, x = torch.empty(64), torch.zeros(64)
    blocks = torch.zeros(2, 100, dtype=torch.uint8)
    call = (blocks.data_ptr(), 2, 32, x.data_ptr(), 1)
    assert lib.quant_gemm(10, *call, 0, 1, 1, out.data_ptr()) == -1  # no such format
    assert lib.quant_gemm(3, blocks.data_ptr(), 2, 40, x.data_ptr(), 1, 0, 1, 1, 0) == -1
    assert lib.quant_gemm(12, *call, 0, 1, 1, out.data_ptr()) == -1  # 32 of a super-block
    assert lib.quant_gemm(3, *call, 0, 2, 1, out.data_ptr()) == -1  # passes 1 or 3
    assert lib.quant_gemm(3, *call, 7, 1, 1, out.data_ptr()) == -3  # no such path
    with pytest.raises(RuntimeError, match="does not run here"):
        quant_gemm.quant_gemm(x.reshape(1, 64), blocks, Format.Q4_1, 64, "tpu")
    assert lib.quant_gemm_int(10, *call, 16, 0, 1, out.data_ptr()) == -1  # no such format
    assert lib.quant_gemm_int(12, *call, 8, 0, 1, out.data_ptr()) == -1  # 32 of a super-block
    assert lib.quant_gemm_int(3, *call, 4, 0, 1, out.data_ptr()) == -1  # bits 8 or 16
    assert lib.quant_gemm_int(3, *call, 16, 5, 1, out.data_ptr()) == -3  # no such path
    with pytest.raises(RuntimeError, match="does not run here"):
        quant_gemm.quant_gemm_int(x.reshape(1, 64), blocks, Format.Q4_1, 64, 16, "amx")


def test_the_paths_are_those_the_cpu_has():
    flags = native.cpu_flags()
    assert "portable" in quant_gemm.paths()
    bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c"} <= flags
    assert ("avx512" in quant_gemm.paths()) == bf16
    if "amx" in quant_gemm.paths():
        assert {"amx_tile", "amx_bf16"} <= flags
    assert quant_gemm.fastest() == next(
        (p for p in ("amx", "avx512") if p in quant_gemm.paths()), None
    )
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    avx2 = {"avx2", "fma"} <= flags
    expected = {"portable"} | ({"vnni"} if vnni else set()) | ({"avx2"} if avx2 else set())
    assert quant_gemm.integer_paths() == expected
    assert quant_gemm.fastest_integer() == ("vnni" if vnni else "avx2" if avx2 else None)


def test_an_avx2_cpu_has_the_avx2_integers_alone(tmp_path):
    """Built for Zen 3 (AVX2, no AVX-512): neither bf16 path nor VNNI is compiled (quant_linear's
    many rows keep the float32 tiles, as before quant_gemm.c), the AVX2 integer path is; the
    portable paths answer within their bounds, and the AVX2 path as the portable one."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = [f for f in native.FLAGS if f != "-march=native"] + ["-march=znver3"]
    target = tmp_path / "quant_gemm_znver3.so"
    subprocess.run([compiler, *flags, str(quant_gemm.SOURCE), "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in quant_gemm.SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    assert lib.quant_gemm_paths() == 1 << quant_gemm.PATHS["portable"]
    assert lib.quant_gemm_int_paths() == sum(
        1 << quant_gemm.INTEGER_PATHS[path] for path in ("portable", "avx2")
    )
    fmt, rows, cols = Format.Q4_K, 40, 512
    blocks = torch.from_numpy(random_blocks(fmt, rows, cols, seed=6))
    weights = dequantize(blocks, fmt)
    x = with_outliers(9, cols)
    out = torch.empty(9, rows)
    call = (fmt.ggml_type, blocks.data_ptr(), rows, cols, x.data_ptr(), 9)
    assert lib.quant_gemm(*call, 0, 3, 1, out.data_ptr()) == 0
    assert error_within(out, x, weights, 3)
    avx2 = torch.empty(9, rows)
    for bits in BITS:
        assert lib.quant_gemm_int(*call, bits, 0, 1, out.data_ptr()) == 0
        error = (out.double() - x.double() @ weights.T).abs()
        levels = quant_gemm.levels(fmt, bits, "portable")
        assert error.le(activation_bound(x, weights, levels)).all()
        path = quant_gemm.INTEGER_PATHS["avx2"]
        assert lib.quant_gemm_int(*call, bits, path, 1, avx2.data_ptr()) == 0
        assert torch.equal(avx2, out)


BITS = [8, 16]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("path", sorted(quant_gemm.INTEGER_PATHS))
@pytest.mark.parametrize(("fmt", "rows", "cols"), shapes(), ids=str)
def test_integers_within_the_activation_bound(bits, path, fmt, rows, cols):
    if path not in quant_gemm.integer_paths():
        pytest.skip(f"this CPU runs no integer {path} path")
    blocks = random_blocks(fmt, rows, cols, seed=rows)
    weights = dequantize(blocks, fmt)
    for n in X_ROWS if path != "portable" else X_ROWS[:2]:
        x = with_outliers(n, cols)
        out = quant_gemm.quant_gemm_int(x, torch.from_numpy(blocks), fmt, cols, bits, path)
        assert out.shape == (n, rows)
        error = (out.double() - x.double() @ weights.T).abs()
        bound = activation_bound(x, weights, quant_gemm.levels(fmt, bits, path))
        assert error.le(bound).all(), (n, path)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("path", ["vnni", "avx2"])
@pytest.mark.parametrize("fmt", list(Format), ids=str)
def test_integer_paths_agree_to_the_bit(bits, path, fmt):
    """VNNI's and AVX2's lanes take the portable code's steps (integer sums, then one or two fused
    multiply-adds a group, groups in order): equal outputs, partial panel and a ragged tail of
    rows included, wherever they quantize x to the same levels."""
    if path not in quant_gemm.integer_paths():
        pytest.skip(f"this CPU runs no {path}")
    if quant_gemm.levels(fmt, bits, path) != quant_gemm.levels(fmt, bits, "portable"):
        pytest.skip("AVX2 quantizes x against Q8_0's bytes to 63 levels, the portable code to 127")
    rows, cols = (45, 512) if fmt.size == 256 else (45, 576)
    blocks = torch.from_numpy(random_blocks(fmt, rows, cols, seed=4))
    x = with_outliers(11, cols)
    portable = quant_gemm.quant_gemm_int(x, blocks, fmt, cols, bits, "portable")
    assert torch.equal(quant_gemm.quant_gemm_int(x, blocks, fmt, cols, bits, path), portable)


@pytest.mark.parametrize("bits", BITS)
def test_integers_are_exact_on_integer_activations(bits):
    """Activations that are integers of at most L with an L in every block quantize exactly (L
    the bits' and path's largest level): the output is then the float64 product up to float32's
    rounding.
    With int16, the products' sums reach 2^28 (Q8_0's 255 against 32767): exact in int32."""
    for (fmt, rows, cols), path in itertools.product(
        ((Format.Q6_K, 33, 512), (Format.Q8_0, 40, 96)), quant_gemm.integer_paths()
    ):
        levels = quant_gemm.levels(fmt, bits, path)
        blocks = random_blocks(fmt, rows, cols, seed=5)
        weights = dequantize(blocks, fmt)
        generator = torch.Generator().manual_seed(5)
        x = torch.randint(-levels, levels + 1, (10, cols), generator=generator).float()
        x[:, ::32] = float(levels)
        out = quant_gemm.quant_gemm_int(x, torch.from_numpy(blocks), fmt, cols, bits, path)
        error = (out.double() - x.double() @ weights.T).abs()
        assert error.le(rounding_bound(x, weights)).all(), (fmt, path)


def test_int8_sums_at_their_extremes_come_out_exact():
    """Q8_0's quants all -128 or all 127 against activations all at the top level: a group's
    integer sum reaches +-32 x 128 x 127, the most an int8 group can, and every path turns it
    into the same float (the vector paths without vcvtdq2ps): equal outputs, each the float64
    product up to float32's rounding."""
    rows, cols = 40, 96
    blocks = random_blocks(Format.Q8_0, rows, cols, seed=6)
    quants = blocks.reshape(rows, cols // 32, 34)[..., 2:]
    quants[: rows // 2] = 0x80  # -128
    quants[rows // 2 :] = 0x7F
    weights = dequantize(blocks, Format.Q8_0)
    for path in sorted({"portable", *quant_gemm.integer_paths()}):
        levels = quant_gemm.levels(Format.Q8_0, 8, path)
        x = torch.full((7, cols), float(levels))
        x[3:] = -levels
        out = quant_gemm.quant_gemm_int(x, torch.from_numpy(blocks), Format.Q8_0, cols, 8, path)
        error = (out.double() - x.double() @ weights.T).abs()
        assert error.le(rounding_bound(x, weights)).all(), path
        if levels == 127:
            portable = quant_gemm.quant_gemm_int(
                x, torch.from_numpy(blocks), Format.Q8_0, cols, 8, "portable"
            )
            assert torch.equal(out, portable), path


@pytest.mark.parametrize(
    ("setting", "product"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("bf16x3", "bf16x3"),
        ("bf16", "bf16"),
        ("int16", "int16"),
        ("int8", "int8"),
        ("float32", None),
    ],
)
@pytest.mark.parametrize("fmt", [Format.Q4_1, Format.Q8_0, Format.Q6_K], ids=str)
@pytest.mark.parametrize("rows", [100, quant_linear.AMX_MIN_ROWS])
def test_quant_linear_takes_it_past_a_few_rows(monkeypatch, setting, product, fmt, rows):
    """`quant_matmul` past a few rows (its small batch and 32): the setting's product on its
    fastest path here (the integers on VNNI, else AVX2), or the float32 tiles (exact mode's
    arithmetic) where float32 is asked or no path runs here (bf16 on AVX2 alone, as Zen 3).
    auto: bf16x3 on AMX (where VNNI's int16 runs too, for weights of 2048 rows or more in Q4_0,
    Q4_1 and Q8_0 alone), else int16 on VNNI, or on AVX2 but for Q4_0 and Q4_1, else the tiles
    (AVX512-BF16's bf16x3 is slower than they are)."""
    if setting is None:
        monkeypatch.delenv(quant_linear.GEMM_SETTING, raising=False)
    else:
        monkeypatch.setenv(quant_linear.GEMM_SETTING, setting)
    integers = quant_gemm.fastest_integer()
    large = fmt in quant_linear.AMX_FORMATS and rows >= quant_linear.AMX_MIN_ROWS
    if product == "auto" and "amx" in quant_gemm.paths():
        product = "bf16x3" if large or integers != "vnni" else "int16"
    elif product == "auto":
        tiles = integers is None or integers == "avx2" and fmt in quant_linear.TILES_ON_AVX2
        product = None if tiles else "int16"
    integer = product in quant_gemm.INTEGER_BITS
    path = integers if integer else quant_gemm.fastest()
    expected = None if product is None or path is None else (product, path)
    assert quant_linear.gemm_path(fmt, rows) == expected
    cols = 576 if fmt.size == 32 else 512
    blocks = random_blocks(fmt, rows, cols, seed=1)
    x = with_outliers(quant_linear.small_batch() + 32, cols)
    weights = dequantize(blocks, fmt)
    out = quant_linear.quant_matmul(x, torch.from_numpy(blocks), fmt, cols)
    error = (out.double() - x.double() @ weights.T).abs()
    if expected is None:
        assert error.le(rounding_bound(x, weights)).all()
    elif product in quant_gemm.INTEGER_BITS:
        levels = quant_gemm.levels(fmt, quant_gemm.INTEGER_BITS[product], path)
        assert error.le(activation_bound(x, weights, levels)).all()
    else:
        assert error_within(out, x, weights, 3 if product == "bf16x3" else 1)
    if expected is not None:
        taken = quant_gemm.multiply(x, torch.from_numpy(blocks), fmt, cols, *expected)
        assert torch.equal(out, taken)


def test_a_setting_it_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv(quant_linear.GEMM_SETTING, "int4")
    with pytest.raises(ValueError, match="auto, bf16x3, bf16, int16, int8 or float32"):
        quant_linear.gemm_path(Format.Q8_0)
