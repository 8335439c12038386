"""QuantizedWeight's approximate product: a bound that holds, and exact rows."""

import numpy as np
import pytest
import torch
from test_quant_blocks import random_blocks

from pagedbatch.kernels import quant_gemm
from pagedbatch.kernels.quant_blocks import Format, dequantize
from pagedbatch.kernels.quant_linear import QuantizedWeight, small_batch

pytestmark = pytest.mark.skipif(
    quant_gemm.fastest() is None, reason="no bf16 path of quant_gemm on this CPU"
)


def weight(fmt: Format, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    blocks = torch.from_numpy(random_blocks(fmt, rows, cols, seed=seed))
    return QuantizedWeight([(blocks, fmt)], cols), dequantize(blocks, fmt, torch.float64)


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_the_approximate_product_is_within_its_bound_of_the_exact_one(fmt):
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


def test_the_bound_is_half_reached_where_every_rounding_errs_the_same_way():
    """Every weight 1 + 3/512 (a Q8_0 scale, its quants 1) and every activation the same:
    bf16 rounds both up by 2^-9, so every product errs by 2^-8 of itself, and Cauchy-Schwarz
    is an equality: the error is half the bound's 2^-7."""
    rows, cols = 16, 256
    block = np.zeros(34, dtype=np.uint8)
    block[:2] = np.array([1 + 3 / 512], dtype=np.float16).view(np.uint8)
    block[2:] = 1
    blocks = torch.from_numpy(np.tile(block, (rows, cols // 32)))
    w = QuantizedWeight([(blocks, Format.Q8_0)], cols)
    x = torch.full((small_batch() + 1, cols), 1 + 3 / 512)
    approx = w.approximate(x, slice(None))
    margin, norms = w.error_bound(x)
    bound = margin[:, None] * norms
    error = approx - (1 + 3 / 512) ** 2 * cols
    assert bool((error <= bound).all()) and bool((error > bound / 2.2).all())


def test_rows_product_is_the_float32_product_of_the_rows_asked():
    w, exact_w = weight(Format.Q8_0, 64, 256, seed=1)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([63, 0, 17, 17])
    torch.testing.assert_close(w.rows_product(x, ids), x @ exact_w[ids].float().T)


def test_few_rows_several_runs_and_other_dtypes_are_not_approximated():
    w, _ = weight(Format.Q4_0, 64, 256, seed=3)
    assert not w.approximates(torch.zeros(small_batch(), 256))
    assert not w.approximates(torch.zeros(small_batch() + 1, 256, dtype=torch.bfloat16))
    two, _ = weight(Format.Q8_0, 64, 256, seed=4)
    joined = QuantizedWeight([*w.runs, *two.runs], 256)
    assert not joined.approximates(torch.zeros(small_batch() + 1, 256))
