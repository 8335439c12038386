"""A decode step's layers in one C call each (`decode_layer.c`, through models/llama.py) against
the same layers' torch path: the same hidden states and KV cache entries to float32's rounding
(the norms' and SiLU's sums run in another order), for a Llama on quantized weights; other
steps and other layers keep the torch path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.torch import load_file
from test_quant_blocks import random_blocks

from pagedbatch.engine import LLM
from pagedbatch.engine.worker.models import llama
from pagedbatch.engine.worker.models.llama import decode_layers
from pagedbatch.kernels import quant_linear
from pagedbatch.kernels.attention import prepare_attention
from pagedbatch.kernels.decode_layer import many_rows_product, run_layer
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import (
    ACTIVATIONS,
    ACTIVATIONS_SETTING,
    QuantizedTensor,
    QuantizedWeight,
    activations_for,
    small_batch,
)

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

PARTS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


def quantized_model(
    checkpoint: Path,
    fmt: Format,
    v_fmt: Format | None = None,
    k_formats: dict | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[LLM, torch.nn.Module]:
    """The checkpoint's engine with every decoder linear on its weights quantized to `fmt`
    (v_proj's to `v_fmt`, where given: q, k and v in two runs of blocks); the parts named in
    `k_formats` in the K format it gives, as random blocks of weights about the checkpoint's
    size (the gguf package does not quantize to K formats)."""
    llm = LLM(checkpoint, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    weights = load_file(str(checkpoint / "model.safetensors"))
    for i, layer in enumerate(model.layers):
        for fused, (block, names) in PARTS.items():
            parts = []
            for name in names:
                w = weights[f"model.layers.{i}.{block}.{name}.weight"].numpy()
                if name in (k_formats or {}):
                    k_fmt = k_formats[name]
                    blocks = random_blocks(k_fmt, *w.shape, seed=i, scale=2e-4)
                    parts.append(QuantizedTensor(torch.from_numpy(blocks), k_fmt, w.shape[1]))
                    continue
                part_fmt = v_fmt if name == "v_proj" and v_fmt else fmt
                blocks = quantize(w.astype(np.float32), GGMLQuantizationType(part_fmt.ggml_type))
                parts.append(QuantizedTensor(torch.from_numpy(blocks), part_fmt, w.shape[1]))
            getattr(getattr(layer, block), fused).packed = QuantizedWeight.join(parts)
    return llm, model


def decode_step(llm: LLM, seq_lens: list[int]) -> tuple:
    """A step of one token for each sequence, its earlier keys and values random in the cache."""
    runner = llm.engine.runner
    block_size = runner.block_size
    generator = torch.Generator().manual_seed(len(seq_lens))
    for key_cache, value_cache in runner.kv_caches:
        key_cache.copy_(torch.randn(key_cache.shape, generator=generator))
        value_cache.copy_(torch.randn(value_cache.shape, generator=generator))
    width = max(-(-n // block_size) for n in seq_lens)
    tables, next_block = [], 0
    for n in seq_lens:
        used = -(-n // block_size)
        tables.append([*range(next_block, next_block + used), *[0] * (width - used)])
        next_block += used
    meta = prepare_attention(
        query_start_loc=torch.arange(len(seq_lens) + 1),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=block_size,
    )
    vocab = llm.engine.model_config.vocab_size
    ids = torch.randint(0, vocab, (len(seq_lens),), generator=generator)
    return ids, meta


def layers_one_by_one(model, ids, meta, kv_caches) -> torch.Tensor:
    """The model's torch path: each layer's own forward."""
    model.cover_positions(meta.max_seq_len)
    x, residual = model.embed_tokens(ids), None
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        x, residual = layer(meta.positions, x, residual, kv_cache, meta)
    return model.norm(x, residual)[0]


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float activations, so that the two paths agree to float32's rounding: on integer ones
    the paths' last bits can put an activation on either side of a rounding step (the setting's
    own test below)."""
    monkeypatch.setenv(ACTIVATIONS_SETTING, "float32")


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per layer run in one call: `run_layer` counted as models/llama.py calls it."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return run_layer(*args, **kwargs)

    monkeypatch.setattr(llama, "run_layer", counted)
    return calls


def fused_against_torch(llm: LLM, model, seq_lens: list[int], fused_calls, tolerance: float):
    """A decode step through the fused layers against the layers' torch path: the hidden states
    and the keys and values each wrote into the cache, within `tolerance`."""
    kv_caches = llm.engine.runner.kv_caches
    ids, meta = decode_step(llm, seq_lens)
    expected = layers_one_by_one(model, ids, meta, kv_caches)
    slots = meta.slot_mapping
    written = [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
               for k, v in kv_caches]  # fmt: skip
    got = model(ids, meta.positions, kv_caches, meta)
    assert len(fused_calls) == len(model.layers)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    for cache_pair, torch_pair in zip(kv_caches, written, strict=True):
        for cache, torch_written in zip(cache_pair, torch_pair, strict=True):
            torch.testing.assert_close(cache.view(-1, *cache.shape[2:])[slots], torch_written,
                                       rtol=tolerance, atol=tolerance)  # fmt: skip


@pytest.mark.parametrize("fmt", [Format.Q4_1, Format.Q8_0, Format.Q5_0])
@pytest.mark.parametrize(
    "seq_lens", [[1], [37], [5, 70, 17], list(range(9, 17)), list(range(9, 9 + small_batch()))]
)
@torch.inference_mode()
def test_a_decode_step_in_one_call_a_layer_matches_the_layers_torch_path(
    tiny_llama, fmt, seq_lens, fused_calls
):
    llm, model = quantized_model(tiny_llama, fmt)
    fused_against_torch(llm, model, seq_lens, fused_calls, tolerance=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@torch.inference_mode()
def test_a_half_precision_cache_is_written_rounded_and_read_in_the_one_call(
    tiny_llama, kv_cache_dtype, fused_calls
):
    llm, model = quantized_model(tiny_llama, Format.Q8_0, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    # Rounded to the cache's dtype by each path: an element within float32's rounding of a
    # rounding boundary may land a step apart.
    step = {"float16": 2**-10, "bfloat16": 2**-7}[kv_cache_dtype]
    fused_against_torch(llm, model, [5, 70, 17], fused_calls, tolerance=step)


@torch.inference_mode()
def test_a_sliding_window_is_followed(make_checkpoint, fused_calls):
    llm, model = quantized_model(make_checkpoint("mistral", sliding_window=48), Format.Q8_0)
    kv_caches = llm.engine.runner.kv_caches
    assert model.layers[0].self_attn.sliding_window == 48
    ids, meta = decode_step(llm, [48 + 40, 3])
    expected = layers_one_by_one(model, ids, meta, kv_caches)
    got = model(ids, meta.positions, kv_caches, meta)
    assert len(fused_calls) == len(model.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seq_lens", [[20], [5, 70, 17]])
@torch.inference_mode()
def test_gemma3s_layers_with_q_k_and_v_in_two_formats(make_checkpoint, seq_lens, fused_calls):
    """Gemma 3's own norms (per head of q and k, on the attention's and the MLP's outputs), its
    GELU, its sliding and full layers; q and k in Q5_0, v in Q8_0 as in its Q4_K_M file."""
    llm, model = quantized_model(make_checkpoint("gemma3"), Format.Q5_0, v_fmt=Format.Q8_0)
    kv_caches = llm.engine.runner.kv_caches
    assert len(model.layers[0].self_attn.qkv_proj.packed.runs) == 2
    ids, meta = decode_step(llm, seq_lens)
    expected = layers_one_by_one(model, ids, meta, kv_caches)
    got = model(ids, meta.positions, kv_caches, meta)
    assert len(fused_calls) == len(model.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seq_lens", [[20], [5, 70, 17]])
@pytest.mark.parametrize("setting", ["auto", "int16", "int8", "float32"])
@torch.inference_mode()
def test_gemma3s_q4_k_m_formats_on_the_activations_the_setting_chooses(
    make_checkpoint, seq_lens, setting, fused_calls, monkeypatch
):
    """Every format of Gemma 3's Q4_K_M file, each product as the few-row path takes it: o in
    Q4_K and down in Q6_K, q, k, gate and up in Q5_0 and v in Q8_0 (K formats need widths of
    256: hidden 256, 4 heads of 64), on the activations `activations_for` chooses. On float
    activations the two paths agree to float32's rounding; on integer ones an activation that the
    paths' last bits put on either side of a rounding step moves by a step (amax / 127 for int8,
    amax / 32767 for int16): the hidden states then differ by about a thousandth of their norm
    with int8."""
    monkeypatch.setenv(ACTIVATIONS_SETTING, setting)
    shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    k_formats = {"o_proj": Format.Q4_K, "down_proj": Format.Q6_K}
    checkpoint = make_checkpoint("gemma3", **shape)
    llm, model = quantized_model(checkpoint, Format.Q5_0, Format.Q8_0, k_formats)
    assert model.layers[0].mlp.down_proj.packed.formats == (Format.Q6_K,)
    kv_caches = llm.engine.runner.kv_caches
    ids, meta = decode_step(llm, seq_lens)
    expected = layers_one_by_one(model, ids, meta, kv_caches)
    got = model(ids, meta.positions, kv_caches, meta)
    assert len(fused_calls) == len(model.layers)
    fused = model._decode_layers[1][0].struct  # what decode_layer.c was given
    linears = (fused.o, fused.down, fused.qkv[0], fused.qkv[1])
    formats = (Format.Q4_K, Format.Q6_K, Format.Q5_0, Format.Q8_0)
    chosen = [activations_for(f) for f in formats]
    assert [linear.activations for linear in linears] == [ACTIVATIONS[a] for a in chosen]
    assert expected.abs().max() > 1  # the random weights kept the hidden states of a model's size
    if set(chosen) == {"float32"}:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    else:
        assert (got - expected).norm() <= 1e-2 * expected.norm()


@pytest.mark.parametrize("product", ["int16", "bf16x3", "auto"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@torch.inference_mode()
def test_many_sequences_run_in_one_call_a_layer_on_quant_gemms_product(
    make_checkpoint, arch, product, fused_calls, monkeypatch
):
    """Past the streamed rows, where many rows' products are quant_gemm.c's (int16 activations,
    or bf16x3 where the CPU has a bf16 path), the layer calls that product itself, as the torch
    path's linears do, with the norms, rotary, the cache writes and the activation in C, split
    among the threads. The two paths' last bits differ (an activation on either side of an
    int16 rounding step moves by its block's amax / 32767; a bf16 split's low part by a bit):
    the hidden states differ by far less than a thousandth of their norm. Gemma 3 with its
    Q4_K_M file's formats (see the test above). With auto each linear takes its own weight's
    product: on AMX with VNNI, with every weight counted large, Gemma's Q8_0 v takes bf16x3 and
    its other linears int16, in the same call."""
    monkeypatch.setenv(quant_linear.GEMM_SETTING, product)
    monkeypatch.setattr(quant_linear, "AMX_MIN_ROWS", 1)  # the test's weights are small
    k_formats = {"o_proj": Format.Q4_K, "down_proj": Format.Q6_K}
    formats = {Format.Q5_0, Format.Q8_0, *k_formats.values()} if arch == "gemma3" else {Format.Q8_0}
    if any(many_rows_product(fmt) is None for fmt in formats):
        pytest.skip(f"many rows take no {product} product here")
    if arch == "gemma3":
        shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
        checkpoint = make_checkpoint("gemma3", **shape)
        llm, model = quantized_model(checkpoint, Format.Q5_0, Format.Q8_0, k_formats)
    else:
        llm, model = quantized_model(make_checkpoint("llama"), Format.Q8_0)
    kv_caches = llm.engine.runner.kv_caches
    # past the streamed rows, a ragged tail for the kernels' passes of 3 (AVX2) and 6 (VNNI) rows
    ids, meta = decode_step(llm, [9 + i % 40 for i in range(small_batch() + 13)])
    expected = layers_one_by_one(model, ids, meta, kv_caches)
    slots = meta.slot_mapping
    written = [k.view(-1, *k.shape[2:])[slots].clone() for k, _ in kv_caches]
    got = model(ids, meta.positions, kv_caches, meta)
    assert len(fused_calls) == len(model.layers)
    assert (got - expected).norm() <= 1e-3 * expected.norm()
    for (cache, _), torch_written in zip(kv_caches, written, strict=True):
        keys = cache.view(-1, *cache.shape[2:])[slots]
        assert (keys - torch_written).norm() <= 1e-3 * torch_written.norm()


@torch.inference_mode()
def test_prefills_and_large_batches_on_the_float32_tiles_keep_the_torch_path(
    tiny_llama, fused_calls, monkeypatch
):
    monkeypatch.setenv(quant_linear.GEMM_SETTING, "float32")  # the tiles, which C does not call
    assert many_rows_product(Format.Q8_0) is None
    llm, model = quantized_model(tiny_llama, Format.Q8_0)
    kv_caches = llm.engine.runner.kv_caches
    ids, meta = decode_step(llm, list(range(9, 10 + small_batch())))
    prefill = prepare_attention(
        torch.tensor([0, 3]), torch.tensor([3]), meta.block_tables[:1], meta.block_size
    )
    for step_ids, step in ((ids, meta), (ids[:3], prefill)):
        expected = layers_one_by_one(model, step_ids, step, kv_caches)
        assert torch.equal(model(step_ids, step.positions, kv_caches, step), expected)
    assert fused_calls == []


def test_float_weights_and_biased_projections_are_not_fused(tiny_llama, tiny_qwen2):
    runner = LLM(tiny_llama, num_kv_blocks=16).engine.runner
    assert decode_layers(runner.model.layers, runner.kv_caches) == []
    llm, qwen2 = quantized_model(tiny_qwen2, Format.Q8_0)
    assert qwen2.layers[0].self_attn.qkv_proj.bias is not None
    assert decode_layers(qwen2.layers, llm.engine.runner.kv_caches) == []
