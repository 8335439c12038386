"""The block layouts and the float64 reference dequantizer, against the `gguf` package's own
dequantizer (llama.cpp's Python reading of the same formats)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedbatch.kernels.quant_blocks import BLOCK, Format, dequantize


def random_blocks(fmt: Format, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of random quants (every nibble and int8 value, -128 included) whose float16 scale
    and minimum are finite and of a weight's size."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // BLOCK, fmt.block_bytes), dtype=np.uint8)
    header = fmt.value.header_bytes // 2
    fields = rng.uniform(-0.05, 0.05, (rows, cols // BLOCK, header)).astype(np.float16)
    raw[..., : 2 * header] = fields.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_layouts_are_the_ggml_types(fmt):
    kind = GGMLQuantizationType(fmt.ggml_type)
    assert kind.name == fmt.name
    block, type_bytes = GGML_QUANT_SIZES[kind]
    assert (block, type_bytes) == (BLOCK, fmt.block_bytes)
    assert Format.of(fmt.ggml_type) is fmt
    assert fmt.row_bytes(576) == 18 * fmt.block_bytes


def test_types_the_kernels_do_not_read():
    assert Format.of(GGMLQuantizationType.F32) is None
    assert Format.of(GGMLQuantizationType.Q4_K) is None
    with pytest.raises(ValueError, match="whole blocks"):
        Format.Q4_1.row_bytes(100)


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
@pytest.mark.parametrize("rows, cols", [(1, 32), (3, 576), (17, 1536), (300, 96)])
def test_reference_matches_gguf_on_random_blocks(fmt, rows, cols):
    blocks = random_blocks(fmt, rows, cols)
    theirs = gguf_dequantize(blocks, GGMLQuantizationType(fmt.ggml_type))
    ours = dequantize(blocks, fmt)
    assert ours.dtype == torch.float64 and ours.shape == (rows, cols)
    # gguf computes in float32: d * q (+ m) rounded once there, exact in float64.
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=2**-23, atol=2**-30)
    np.testing.assert_array_equal(dequantize(blocks, fmt, torch.float32).numpy(), theirs)


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_quantized_weights_come_back_within_the_formats_step(fmt):
    weights = np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32)
    blocks = gguf_quantize(weights, GGMLQuantizationType(fmt.ggml_type))
    back = dequantize(blocks, fmt).numpy()
    per_block = np.abs(weights).reshape(5, -1, BLOCK).max(-1, keepdims=True)
    # Half a step: Q4_1's is (max - min) / 15, Q8_0's amax / 127. Q4_0's is amax / 8, and the
    # block's extreme of the other sign than its scale is clipped a whole step (q = 16 -> 15).
    bound = {
        Format.Q4_0: per_block / 8,
        Format.Q4_1: per_block / 15,
        Format.Q8_0: per_block / 254,
    }[fmt]
    error = np.abs(back - weights).reshape(5, -1, BLOCK)
    assert (error <= bound * 1.001 + 1e-3).all()


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(np.zeros((2, 19), np.uint8), Format.Q4_0)
