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

# Where each format's float16 fields (d, and m or dmin) lie in its block.
HALVES = {
    Format.Q4_0: (0,),
    Format.Q4_1: (0, 2),
    Format.Q5_0: (0,),
    Format.Q8_0: (0,),
    Format.Q4_K: (0, 2),
    Format.Q5_K: (0, 2),
    Format.Q6_K: (208,),
}
# Shapes for each block size: SmolLM2's (hidden 576, intermediate 1536) and Gemma 3 270M's
# K-format ones (attention output 1024 wide, down projection 2048), and odd ones.
SHAPES = {
    32: [(1, 32), (3, 576), (17, 1536), (300, 96)],
    256: [(1, 256), (3, 1024), (17, 2048), (300, 512)],
}


def random_blocks(
    fmt: Format, rows: int, cols: int, seed: int = 0, scale: float = 0.05
) -> np.ndarray:
    """Blocks of random quants (every bit pattern: all nibbles, int8 -128, every packed scale)
    whose float16 fields are finite and of a weight's size (uniform within +-`scale`)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // fmt.size, fmt.block_bytes), dtype=np.uint8)
    for at in HALVES[fmt]:
        half = rng.uniform(-scale, scale, (rows, cols // fmt.size, 1)).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8)
    return raw.reshape(rows, -1)


def format_shapes() -> list[tuple[Format, int, int]]:
    return [(f, rows, cols) for f in Format for rows, cols in SHAPES[f.size]]


@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
def test_layouts_are_the_ggml_types(fmt):
    kind = GGMLQuantizationType(fmt.ggml_type)
    assert kind.name == fmt.name
    block, type_bytes = GGML_QUANT_SIZES[kind]
    assert (block, type_bytes) == (fmt.size, fmt.block_bytes)
    assert Format.of(fmt.ggml_type) is fmt
    assert fmt.row_bytes(2048) == 2048 // fmt.size * fmt.block_bytes
    assert fmt.cols(fmt.row_bytes(2048)) == 2048


def test_types_the_kernels_do_not_read():
    assert Format.of(GGMLQuantizationType.F32) is None
    assert Format.of(GGMLQuantizationType.Q3_K) is None
    with pytest.raises(ValueError, match="whole blocks"):
        Format.Q4_1.row_bytes(100)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        Format.Q4_K.row_bytes(640)  # why Gemma's Q4_K_M file stores its 640-wide rows as Q5_0


@pytest.mark.parametrize(("fmt", "rows", "cols"), format_shapes(), ids=str)
def test_reference_matches_gguf_on_random_blocks(fmt, rows, cols):
    blocks = random_blocks(fmt, rows, cols)
    theirs = gguf_dequantize(blocks, GGMLQuantizationType(fmt.ggml_type))
    ours = dequantize(blocks, fmt)
    assert ours.dtype == torch.float64 and ours.shape == (rows, cols)
    # gguf computes in float32, where a weight is its exact value rounded once.
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=2**-23, atol=2**-30)
    np.testing.assert_array_equal(dequantize(blocks, fmt, torch.float32).numpy(), theirs)


@pytest.mark.parametrize("fmt", [f for f in Format if f.size == BLOCK], ids=lambda f: f.name)
def test_quantized_weights_come_back_within_the_formats_step(fmt):
    weights = np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32)
    blocks = gguf_quantize(weights, GGMLQuantizationType(fmt.ggml_type))
    back = dequantize(blocks, fmt).numpy()
    per_block = np.abs(weights).reshape(5, -1, BLOCK).max(-1, keepdims=True)
    # Half a step: Q4_1's is (max - min) / 15, Q8_0's amax / 127. Q4_0's is amax / 8 (Q5_0's
    # amax / 16), and the block's extreme of the other sign than its scale is clipped a whole
    # step (q = 16 -> 15; 32 -> 31).
    bound = {
        Format.Q4_0: per_block / 8,
        Format.Q4_1: per_block / 15,
        Format.Q5_0: per_block / 16,
        Format.Q8_0: per_block / 254,
    }[fmt]
    error = np.abs(back - weights).reshape(5, -1, BLOCK)
    assert (error <= bound * 1.001 + 1e-3).all()


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(np.zeros((2, 19), np.uint8), Format.Q4_0)
