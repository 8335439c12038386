"""QuantizedWeight's approximate product: a bound that holds, and exact rows."""

import numpy as np
import pytest
import torch
from test_quant_blocks import random_blocks

from pagedbatch.kernels import quant_gemm, quant_linear
from pagedbatch.kernels.quant_blocks import Format, dequantize
from pagedbatch.kernels.quant_linear import QuantizedWeight, small_batch

# The screens this CPU runs: one bf16 product, int8 activations.
SCREENS = [
    screen
    for screen in (("bf16", quant_gemm.fastest()), ("int8", quant_gemm.fastest_integer()))
    if screen[1] is not None
]
pytestmark = pytest.mark.skipif(not SCREENS, reason="neither screen runs on this CPU")


@pytest.fixture(params=SCREENS, ids=lambda screen: screen[0])
def screen(request, monkeypatch):
    """Each screen this CPU runs, as the one QuantizedWeight takes."""
    monkeypatch.setattr(quant_linear, "screen_product", lambda: request.param)
    return request.param


def weight(fmt: Format, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    blocks = torch.from_numpy(random_blocks(fmt, rows, cols, seed=seed))
    return QuantizedWeight([(blocks, fmt)], cols), dequantize(blocks, fmt, torch.float64)


def equal_rows(rows: int, cols: int, scale: float, quant: int) -> QuantizedWeight:
    """A Q8_0 weight whose every weight is scale (a half) times quant."""
    fmt = Format.Q8_0
    block = np.zeros(fmt.block_bytes, dtype=np.uint8)
    block[:2] = np.array([scale], dtype=np.float16).view(np.uint8)
    block[2:] = quant
    return QuantizedWeight([(torch.from_numpy(np.tile(block, (rows, cols // 32))), fmt)], cols)


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_the_approximate_product_is_within_its_bound_of_the_exact_one(screen, fmt):
    w, exact_w = weight(fmt, 300, 512, seed=fmt.ggml_type)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(small_batch() + 8, 512, generator=generator)
    x[3, 7] = 400.0  # an outlier, as real hidden states have
    x[5] *= 1e-3
    assert w.approximates(x)
    approx = w.approximate(x, slice(40, 290))
    margin, norms = w.error_bound(x)
    exact = (x.double() @ exact_w[40:290].T).float()
    error = (approx - exact).abs()
    assert bool((error <= margin[:, None] * norms[40:290]).all())


def test_the_bound_is_tight_where_every_rounding_errs_the_same_way(screen):
    """Every weight equal, and every activation's rounding erring the same way, Cauchy-Schwarz
    is an equality. bf16: every weight and activation 1 + 3/512, both rounded up by 2^-9, each
    product errs by 2^-8 of itself, half the bound's 2^-7. int8: every weight 1 (64 / 64), and
    in each block of 32 one activation 63 (its block's scale 1) and 31 of 0.4 (each quantized to
    0): the error is sqrt(31 / 32) of the bound's ||w|| ||x - x'||."""
    rows, cols = 16, 256
    if screen[0] == "bf16":
        value = 1 + 3 / 512
        w = equal_rows(rows, cols, value, 1)
        x = torch.full((small_batch() + 1, cols), value)
        least = 1 / 2.2
    else:
        value = 1.0
        w = equal_rows(rows, cols, 1 / 64, 64)
        x = torch.full((small_batch() + 1, cols), 0.4)
        x[:, ::32] = 63.0
        least = 0.9
    approx = w.approximate(x, slice(None))
    margin, norms = w.error_bound(x)
    bound = margin[:, None] * norms
    error = (approx.double() - x.double().sum(1, keepdim=True) * value).abs()
    assert bool((error <= bound).all()) and bool((error > bound * least).all())


def test_the_int8_norms_take_offsets_only_where_the_format_has_its_own(monkeypatch):
    """int8 takes a block's quants unsigned. Q8_0's offset (-128 times the scale) starts each
    group's integer sum, so its norms are the weights' even where they are all 0. Q4_1's mins are
    float terms of their own, whose roundings grow with them: a row whose weights are 0 (quants 8,
    min -8 times the scale) takes 2 / 64 of its offsets' norm."""
    path = quant_gemm.fastest_integer()
    if path is None:
        pytest.skip("no integer path of quant_gemm on this CPU")
    monkeypatch.setattr(quant_linear, "screen_product", lambda: ("int8", path))
    w, _ = weight(Format.Q8_0, 64, 256, seed=8)
    w.runs[0][0].view(64, 8, 34)[5, :, 2:] = 0  # weights 0
    _, norms = w.error_bound(torch.randn(small_batch() + 1, 256))
    plain = torch.linalg.vector_norm(dequantize(w.runs[0][0], Format.Q8_0), dim=1).float()
    torch.testing.assert_close(norms, plain, rtol=2e-3, atol=quant_linear.SUBNORMAL_SLACK)
    assert float(norms[5]) <= 2 * quant_linear.SUBNORMAL_SLACK

    w, _ = weight(Format.Q4_1, 64, 256, seed=9)
    row = w.runs[0][0].view(64, 8, 20)[5]
    row[:, 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # scale 1.0 (float16)
    row[:, 2:4] = torch.tensor([0x00, 0xC8], dtype=torch.uint8)  # min -8.0
    row[:, 4:] = 0x88  # every quant 8
    _, norms = w.error_bound(torch.randn(small_batch() + 1, 256))
    offsets = 8 * 256**0.5
    torch.testing.assert_close(norms[5].item(), 2 * offsets / 64, rtol=2e-3, atol=0)


def test_rows_product_is_the_float32_product_of_the_rows_asked():
    w, exact_w = weight(Format.Q8_0, 64, 256, seed=1)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([63, 0, 17, 17])
    torch.testing.assert_close(w.rows_product(x, ids), x @ exact_w[ids].float().T)


def test_few_rows_several_runs_and_other_dtypes_are_not_approximated():
    """Up to the small batch, or SCREEN_BATCH where more rows stream (AVX2), the product streams
    the blocks once and no screen pays."""
    w, _ = weight(Format.Q4_0, 64, 256, seed=3)
    few = min(small_batch(), quant_linear.SCREEN_BATCH)
    assert not w.approximates(torch.zeros(few, 256))
    assert w.approximates(torch.zeros(few + 1, 256))
    assert not w.approximates(torch.zeros(few + 1, 256, dtype=torch.bfloat16))
    two, _ = weight(Format.Q8_0, 64, 256, seed=4)
    joined = QuantizedWeight([*w.runs, *two.runs], 256)
    assert not joined.approximates(torch.zeros(few + 1, 256))
