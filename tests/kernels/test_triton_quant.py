"""The Triton kernels on GGUF blocks (`triton_quant`) against the float64 reference
(x @ dequantize(blocks).T) and against the C kernels (`quant_linear.quant_matmul` on the CPU);
and a tiny GGUF model computing on its blocks through them, end to end.

The bound, per output: the weights rounded once to float32 (and, on the tensor cores, to the
activations' half dtype), K + 2 float32 roundings of the sums, and the output's rounding to its
dtype, each relative to sum |x| |w| (the rigorous float error bound of a dot product of K terms).

Without a GPU these run in Triton's interpreter, whose cost is per program and op: the matrices
keep their real widths (K: SmolLM2-135M's 576 and 1536, Gemma 3 270M's 640, 1024 and 2048) and
take their first `INTERPRETED_ROWS` rows, two column tiles and a ragged one's worth; on a GPU
their whole rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from test_quant_blocks import HALVES, random_blocks

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.kernels import native, ops, quant_linear, triton_quant
from pagedbatch.kernels.quant_blocks import Format, dequantize
from pagedbatch.kernels.quant_linear import QuantizedTensor, QuantizedWeight

INTERPRETED_ROWS = 72
# Each format on the linears of the models that use it: (name, rows, cols); K formats need
# widths of whole super-blocks (Gemma's 640-wide rows are Q5_0 and Q8_0 in its Q4_K_M file).
SMOLLM2 = [("smollm2-q", 576, 576), ("smollm2-down", 576, 1536)]
GEMMA3 = [("gemma3-q", 1024, 640), ("gemma3-down", 640, 2048)]
GEMMA3_K = [("gemma3-o", 640, 1024), ("gemma3-down", 640, 2048)]
SHAPES = {
    Format.Q4_0: SMOLLM2,
    Format.Q4_1: SMOLLM2,
    Format.Q5_0: GEMMA3,
    Format.Q8_0: [SMOLLM2[0], GEMMA3[1]],
    Format.Q4_K: GEMMA3_K,
    Format.Q5_K: GEMMA3_K,
    Format.Q6_K: GEMMA3_K,
}
# Activation rows: each shape a decode's and a prefill's.
ROWS = [(1, 17), (3, 64)]
HALF_UNIT = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 0.0}
# float16 fields to the extremes: the largest, the smallest normal and subnormal, zero, signs.
EXTREME_HALVES = np.array([65504.0, -65504.0, 2**-14, 2**-24, -(2**-24), 0.0, 1.0, -0.5])


def fmt_id(fmt: Format) -> str:
    return fmt.name


def cases() -> list[tuple[Format, str, int, int, int]]:
    return [
        pytest.param(fmt, rows, cols, m, id=f"{fmt.name}-{name}-m{m}")
        for fmt, shapes in SHAPES.items()
        for (name, rows, cols), pair in zip(shapes, ROWS, strict=True)
        for m in pair
    ]


def kept_rows(rows: int, device: str) -> int:
    return rows if device == "cuda" else min(rows, INTERPRETED_ROWS)


def activations(m: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hidden states as a model's are: mostly small, a few features 30 times more."""
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m + cols))
    x[:, 5::97] *= 30
    return x.to(dtype)


def bound(x: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per output `[m, rows]`: what the module's docstring says the kernels may be off by."""
    unit = 2 * HALF_UNIT[dtype] + (x.shape[1] + 2) * 2**-24
    return unit * (x.double().abs() @ weights.abs().T) + 1e-30


def check(blocks: np.ndarray, fmt: Format, x: torch.Tensor, device: str, **tiles) -> torch.Tensor:
    """triton_quant's product (on the GPU's tiles for x's rows, unless `tiles` says) within the
    bound of the float64 reference's; returned (float64, on the CPU)."""
    stored = torch.from_numpy(blocks).to(device)
    tiles.setdefault("config", triton_quant.config_for(x.shape[0], on_cuda=True))
    out = triton_quant.quant_matmul(x.to(device), stored, fmt, x.shape[1], **tiles)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], blocks.shape[0])
    weights = dequantize(blocks, fmt)
    exact = x.double() @ weights.T
    error = (out.cpu().double() - exact).abs()
    limit = bound(x, weights, x.dtype)
    assert error.le(limit).all(), f"{(error / limit).max().item():.3g} times the bound"
    return out.cpu().double()


def c_kernel(blocks: np.ndarray, fmt: Format, x: torch.Tensor) -> torch.Tensor:
    """The C kernels' float path (`quant_matmul_float`, float32 activations as given) on every
    row; skipped where they are not built."""
    lib = native.library()
    if lib is None:
        pytest.skip("the C kernels are not built here")
    stored = torch.from_numpy(blocks)
    return quant_linear._small_batch(lib, x, stored, fmt, x.shape[1], "float32").double()


@pytest.mark.parametrize(("fmt", "rows", "cols", "m"), cases())
def test_the_models_linears_against_the_reference_and_the_c_kernel(fmt, rows, cols, m, device):
    blocks = random_blocks(fmt, kept_rows(rows, device), cols, seed=rows + m)
    x = activations(m, cols)
    ours = check(blocks, fmt, x, device)
    weights = dequantize(blocks, fmt)
    theirs = c_kernel(blocks, fmt, x)
    assert (ours - theirs).abs().le(2 * bound(x, weights, torch.float32)).all()


# (name, tiles, K, splits of K)
TAILS = [
    # K = 576 on tiles of 128: a tail of half a tile; split five ways, 128 each, the last 64.
    ("decode-split5", triton_quant.DECODE, 576, 5),
    # K = 1280 split three ways: 512, 512 and 256.
    ("decode-split3", triton_quant.DECODE, 1280, 3),
    # K = 96 and 768 on tiles of 64 and 512: ragged tails.
    ("prefill-tail", triton_quant.PREFILL, 96, 1),
    ("wide-tail", triton_quant.TileConfig(16, 32, 512, 4), 768, 1),
]


@pytest.mark.parametrize(
    ("fmt", "config", "cols", "split_k"),
    [
        pytest.param(fmt, config, cols, split_k, id=f"{fmt.name}-{name}")
        for fmt in Format
        for name, config, cols, split_k in TAILS
        if cols % fmt.size == 0
    ],
)
def test_tails_and_splits_of_k(fmt, config, cols, split_k, device):
    blocks = random_blocks(fmt, 40, cols, seed=cols)
    check(blocks, fmt, activations(3, cols), device, config=config, split_k=split_k)


def extreme_blocks(fmt: Format, rows: int, cols: int) -> np.ndarray:
    """random_blocks with every float16 field drawn from EXTREME_HALVES."""
    raw = random_blocks(fmt, rows, cols, seed=7).reshape(rows, -1, fmt.block_bytes)
    rng = np.random.default_rng(1)
    for at in HALVES[fmt]:
        half = rng.choice(EXTREME_HALVES, (rows, raw.shape[1], 1)).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", list(Format), ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float32], ids=["float32"])
def test_extreme_scales_and_the_row_lookup(fmt, dtype, device):
    """The largest and the subnormal float16 scales, every quant, in both configurations; and
    the embedding's lookup (dequantize), each weight its exact value rounded once."""
    cols = 2 * fmt.size + (32 if fmt.size == 32 else 0)
    blocks = extreme_blocks(fmt, 40, cols)
    for m in (2, 20):
        check(blocks, fmt, activations(m, cols, dtype), device)
    picked = torch.from_numpy(blocks[[3, 0, 39, 3]]).to(device)
    rows = triton_quant.dequantize(picked, fmt, cols)
    expected = dequantize(blocks[[3, 0, 39, 3]], fmt)
    torch.testing.assert_close(rows.cpu().double(), expected, rtol=2**-24, atol=0)


@pytest.mark.parametrize("fmt", list(Format), ids=fmt_id)
@pytest.mark.parametrize(
    ("dtype", "m"), [(torch.float16, 3), (torch.bfloat16, 17)], ids=["float16", "bfloat16"]
)
def test_half_activations(fmt, dtype, m, device):
    name, rows, cols = SHAPES[fmt][0]
    blocks = random_blocks(fmt, kept_rows(rows, device), cols, seed=m)
    # A sixteenth of the usual size: Q6_K's outputs stay far from float16's largest (65504).
    check(blocks, fmt, activations(m, cols, dtype) / 16, device)


def test_what_the_kernels_do_not_read_is_refused(device):
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="Q4_0 rows of 64 weights take 36 bytes"):
        triton_quant.quant_matmul(x, torch.zeros(4, 34, dtype=torch.uint8, device=device),
                                  Format.Q4_0, 64)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous uint8"):
        triton_quant.quant_matmul(x, torch.zeros(4, 36, device=device), Format.Q4_0, 64)


@pytest.fixture
def triton_kernels(monkeypatch):
    """PAGEDBATCH_KERNELS=triton for one test, the choice forgotten before and after."""
    monkeypatch.setenv(ops.SETTING, "triton")
    ops.reset()
    yield
    ops.reset()


def test_a_quantized_weight_and_lookup_run_on_triton_where_chosen(triton_kernels, device):
    """QuantizedWeight (runs of two formats, a bias) and QuantizedTensor's lookup, on the
    device's blocks, through the Triton kernels, in the activations' dtype."""
    parts = [random_blocks(Format.Q4_K, 24, 256, seed=1), random_blocks(Format.Q8_0, 40, 256)]
    weight = QuantizedWeight(
        [(torch.from_numpy(parts[0]).to(device), Format.Q4_K),
         (torch.from_numpy(parts[1]).to(device), Format.Q8_0)], 256
    )  # fmt: skip
    x = activations(6, 256).reshape(2, 3, 256).to(device)
    bias = torch.randn(64, device=device)
    out = weight(x, bias)
    weights = torch.cat([dequantize(parts[0], Format.Q4_K), dequantize(parts[1], Format.Q8_0)])
    exact = x.cpu().double() @ weights.T + bias.cpu().double()
    limit = bound(x.cpu().reshape(6, 256), weights, torch.float32).reshape(2, 3, 64) + 1e-6
    assert out.shape == (2, 3, 64) and (out.cpu().double() - exact).abs().le(limit).all()
    table = QuantizedTensor(torch.from_numpy(parts[1]), Format.Q8_0, 256).to(torch.device(device))
    assert table.blocks.device.type == device
    ids = torch.tensor([[5, 0], [39, 5]], device=device)
    looked_up = table.take_rows(ids)
    expected = dequantize(parts[1], Format.Q8_0)[ids.cpu()]
    torch.testing.assert_close(looked_up.cpu().double(), expected, rtol=2**-24, atol=0)


# A one-layer Llama whose linears take every format: q, k and v in three (one fused linear of
# three runs), o in Q4_K, gate and up in Q5_K and Q8_0, down in Q6_K; a Q8_0 embedding and a
# Q6_K LM head of its own. The vocabulary: the 256 bytes and three special tokens.
TINY_FORMATS = {
    "attn_q": Format.Q4_0,
    "attn_k": Format.Q4_1,
    "attn_v": Format.Q5_0,
    "attn_output": Format.Q4_K,
    "ffn_gate": Format.Q5_K,
    "ffn_up": Format.Q8_0,
    "ffn_down": Format.Q6_K,
}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as the printable character it is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path) -> Path:
    rng = np.random.default_rng(0)
    tokens = [*_byte_tokens(), "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)

    def quantized(name: str, rows: int, cols: int, fmt: Format) -> None:
        kind = GGMLQuantizationType(fmt.ggml_type)
        if fmt.size == 32:  # gguf quantizes these; weights of a unit row norm's size
            weights = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
            blocks = quantize(weights, kind)
        else:  # not those: random quants, their scales shrunk to weights of that size
            blocks = random_blocks(fmt, rows, cols, seed=rows + cols).reshape(
                rows, -1, fmt.block_bytes
            )
            for at in HALVES[fmt]:
                half = rng.uniform(-1, 1, (rows, blocks.shape[1], 1)) / (1000 * np.sqrt(cols))
                blocks[..., at : at + 2] = half.astype(np.float16).view(np.uint8)
            blocks = blocks.reshape(rows, -1)
        writer.add_tensor(name, blocks, raw_dtype=kind)

    quantized("token_embd.weight", len(tokens), HIDDEN, Format.Q8_0)
    quantized("output.weight", len(tokens), HIDDEN, Format.Q6_K)
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    for part, fmt in TINY_FORMATS.items():
        quantized(f"blk.0.{part}.weight", *shapes[part], fmt)
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(norm, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-mixed.gguf")


def test_a_tiny_gguf_computes_on_its_blocks_through_triton(tiny_gguf, monkeypatch, device):
    """quantization gguf with PAGEDBATCH_KERNELS=triton (every linear, the lookup and the head
    on triton_quant; on the CPU with the C kernels off, so that decode steps take it too) gives
    the greedy tokens of the exact mode (the blocks dequantized at load, torch's kernels)."""
    prompts = [[256, 72, 101, 108, 108, 111, 44, 32, 119], [256, 65, 66]]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate(setting: str, quantization: str) -> tuple[list[list[int]], LLM]:
        monkeypatch.setenv(ops.SETTING, setting)
        ops.reset()
        llm = LLM(tiny_gguf, device=device, dtype="float32", quantization=quantization,
                  block_size=4, num_kv_blocks=8, max_num_batched_tokens=16)  # fmt: skip
        return [o.token_ids for o in llm.generate(prompts, greedy)], llm

    expected, _ = generate("torch", "none")
    monkeypatch.setenv(native.SETTING, "0")
    native.library.cache_clear()
    try:
        tokens, llm = generate("triton", "gguf")
    finally:
        native.library.cache_clear()
        ops.reset()
    model = llm.engine.runner.model
    weights = [
        m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), QuantizedWeight)
    ]
    formats = [w.formats for w in weights]
    # qkv in three runs, o, gate/up in two, down, and the head.
    assert len(formats) == 5 and (Format.Q4_0, Format.Q4_1, Format.Q5_0) in formats
    assert (Format.Q5_K, Format.Q8_0) in formats
    assert model.embed_tokens.quantized.blocks.device.type == device
    assert all(blocks.device.type == device for w in weights for blocks, _ in w.runs)
    assert tokens == expected
