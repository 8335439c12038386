"""quantization gguf: a GGUF's Q4_0/Q4_1/Q8_0 weights kept in their blocks, the linears
computing on them (`QuantizedWeight`), against the exact mode (`none`) that dequantizes them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.worker import gguf
from pagedbatch.engine.worker.gguf import TensorEntry
from pagedbatch.engine.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    quantize_linears,
)
from pagedbatch.kernels import quant_linear
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import (
    ACTIVATIONS_SETTING,
    QuantizedTensor,
    QuantizedWeight,
    activations_for,
)

SMOLLM2 = "smollm2-135m-instruct"


def quantized(weights: np.ndarray, fmt: Format) -> QuantizedTensor:
    blocks = quantize(weights.astype(np.float32), GGMLQuantizationType(fmt.ggml_type))
    return QuantizedTensor(torch.from_numpy(blocks), fmt, weights.shape[1])


def test_a_fused_linear_keeps_its_parts_blocks_in_runs_of_one_format(monkeypatch):
    monkeypatch.setenv(ACTIVATIONS_SETTING, "float32")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((rows, 96)) for rows in (64, 32, 32))
    x = torch.randn(2, 96)

    def fused(*parts: QuantizedTensor | torch.Tensor) -> ColumnParallelLinear:
        linear = ColumnParallelLinear(96, [64, 32, 32], bias=False, what="test")
        for index, part in enumerate(parts):
            linear.weight_loader(linear.weight, part, index)
        return linear

    parts = [quantized(q, Format.Q4_1), quantized(k, Format.Q4_1), quantized(v, Format.Q8_0)]
    mixed = fused(*parts)
    one = fused(*(quantized(w, Format.Q8_0) for w in (q, k, v)))
    partly = fused(parts[0], parts[1], torch.from_numpy(v).float())
    model = torch.nn.ModuleList([mixed, one, partly])
    q8_bytes = 128 * 3 * Format.Q8_0.block_bytes
    mixed_bytes = 96 * 3 * Format.Q4_1.block_bytes + 32 * 3 * Format.Q8_0.block_bytes
    assert quantize_linears(model) == (2, q8_bytes + mixed_bytes)
    assert mixed.packed.formats == (Format.Q4_1, Format.Q8_0) and mixed.weight.numel() == 0
    assert one.packed.formats == (Format.Q8_0,) and one.packed.rows == 128
    weights = torch.cat([p[:] for p in parts])
    # The float path: float32's rounding alone (tests/kernels/test_quant_matmul.py bounds it).
    assert ((mixed(x) - x @ weights.T).abs() <= 1e-5 * (x.abs() @ weights.abs().T)).all()
    # One part not in blocks: the others are dequantized beside it, as exact mode loads them.
    assert partly.packed is None
    expected = torch.cat([parts[0][:], parts[1][:], torch.from_numpy(v).float()])
    torch.testing.assert_close(partly.weight.data, expected, rtol=0, atol=0)


def test_a_row_parallel_linear_with_a_float_checkpoint_stays_as_it_was():
    linear = RowParallelLinear(64, 8, bias=True, what="test")
    linear.weight_loader(linear.weight, torch.ones(8, 64))
    assert quantize_linears(torch.nn.ModuleList([linear])) == (0, 0)
    assert linear.packed is None and linear.weight.shape == (8, 64)


def test_rows_reordered_by_the_processor_are_followed_and_other_changes_refused():
    llama = gguf._processor({"model_type": "llama", "num_attention_heads": 4,
                             "num_key_value_heads": 2})  # fmt: skip
    entry = TensorEntry("blk.0.attn_k.weight", "k", 8, 0, "|u1", [16, 34])
    order = gguf._row_order(llama, entry)
    assert sorted(order) == list(range(16)) and list(order) != list(range(16))
    gemma = gguf._processor({"model_type": "gemma3_text"})
    norm = TensorEntry("blk.0.attn_norm.weight", "n", 8, 0, "|u1", [4, 34])
    assert gguf._row_order(gemma, norm) is None  # stored as 1 + weight: not a reordering


def test_quantization_gguf_needs_a_gguf_file(tiny_llama: Path):
    with pytest.raises(ValueError, match="needs a GGUF model file"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="gguf")


@pytest.mark.real_model
def test_the_kept_blocks_are_the_exact_modes_weights(real_model):
    path = real_model(SMOLLM2)
    exact = dict(gguf.iterate_weights(path))
    kept = dict(gguf.iterate_weights(path, keep_quantized=True))
    assert kept.keys() == exact.keys()
    formats = {}
    for name, tensor in kept.items():
        if isinstance(tensor, QuantizedTensor):
            formats[name] = tensor.fmt
            torch.testing.assert_close(tensor[:], exact[name], rtol=0, atol=0)
        else:
            torch.testing.assert_close(tensor, exact[name], rtol=0, atol=0)
    # The PyPI file: Q4_1 linears (q and k with their rows reordered) and a Q8_0 embedding.
    assert formats.pop("model.embed_tokens.weight") is Format.Q8_0
    assert len(formats) == 30 * 7 and set(formats.values()) == {Format.Q4_1}


@pytest.mark.real_model
def test_smollm2_computes_on_its_blocks_and_agrees_with_exact_mode(real_model, caplog):
    path = real_model(SMOLLM2)
    prompts = [
        "What is the capital of Germany?",
        "What is 2 + 2?",
        "List three primary colors.",
        "Write a haiku about the sea.",
    ]
    answers = {}
    for mode in ("none", "gguf"):
        with caplog.at_level(logging.INFO):
            # Unset, quantization is what the file holds: gguf.
            llm = LLM(path, num_kv_blocks=64, quantization=None if mode == "gguf" else mode)
        assert llm.engine.runner.quantization == mode
        # kv_cache_dtype auto: float16 on the blocks (llama.cpp's cache), the activations' float32
        # in exact mode.
        assert (
            llm.engine.runner.kv_cache_dtype == {"none": torch.float32, "gguf": torch.float16}[mode]
        )
        chats = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        outputs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=24))
        answers[mode] = [o.outputs[0] for o in outputs]
        if mode == "gguf":
            model, resident = llm.engine.runner.model, llm.engine.resident
    # Every linear on its blocks, the float weights gone; the tied head on the embedding's.
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert len(linears) == 30 * 4
    assert all(isinstance(m.packed, QuantizedWeight) and m.weight.numel() == 0 for m in linears)
    assert model.lm_head.packed.formats == (Format.Q8_0,) and model.lm_head.packed.rows == 49152
    (head_blocks, _), lookup = model.lm_head.packed.runs[0], model.embed_tokens.quantized
    assert head_blocks.data_ptr() == lookup.blocks.data_ptr()  # one copy for both
    assert model.embed_tokens.weight.numel() == 0  # its lookups read the blocks
    # Resident: each linear's blocks and the embedding's once; the float weights are the norms'
    # and RoPE's tables.
    assert resident.quantized_bytes == sum(m.packed.nbytes for m in linears) + lookup.blocks.numel()
    assert resident.weights_bytes < 4 * 2**20
    logged = "121 linears compute on their GGUF blocks: 92.0 MiB; the model's other parameters"
    assert f"{logged} hold 0.1 MiB" in caplog.text

    quantized_text = [a.text for a in answers["gguf"]]
    assert "Berlin" in quantized_text[0] and "4" in quantized_text[1], quantized_text
    # Greedy tokens agreeing before the first difference: all 62 agreed with float activations
    # (their sums differ from exact mode's in their order only) on the machine that wrote this,
    # and with int16 ones (the default with AVX2) on a Zen 3 EPYC; int8 activations
    # (PAGEDBATCH_QUANT_ACTIVATIONS=int8): 55.
    agreeing = total = 0
    for exact, approx in zip(answers["none"], answers["gguf"], strict=True):
        pairs = list(zip(exact.token_ids, approx.token_ids, strict=False))
        agreeing += next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        total += len(exact.token_ids)
    assert agreeing >= 0.9 * total, (answers["none"], quantized_text)


@pytest.mark.real_model
def test_gemma_computes_on_its_k_quant_blocks_and_agrees_with_exact_mode(real_model):
    """Gemma 3 270M's Q4_K_M file: Q5_0 (its 640-wide rows), Q4_K, Q6_K and Q8_0 tensors, a
    fused q/k/v's parts in different formats (v in Q8_0)."""
    path = real_model("gemma-3-270m")
    prompts = [
        "The capital of France is",
        "Two plus two equals",
        "The largest planet in the solar system is",
        "Water boils at",
        "The author of Hamlet is",
        "In 1969, humans first",
    ]
    answers = {}
    for mode in ("none", "gguf"):
        llm = LLM(path, num_kv_blocks=64, quantization=mode)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        answers[mode] = [list(o.outputs[0].token_ids) for o in outputs]
    model = llm.engine.runner.model
    packed = [getattr(m, "packed", None) for m in model.modules()]
    formats = {p.formats for p in packed if isinstance(p, QuantizedWeight)}
    # q/k/v in two runs where v is Q8_0; gate/up, the output and down projections in one.
    assert (Format.Q5_0, Format.Q8_0) in formats
    assert {(Format.Q5_0,), (Format.Q4_K,), (Format.Q6_K,), (Format.Q8_0,)} <= formats
    # Few-row products take int16 or float32 activations, the faster on this CPU, where the C
    # kernels stream the format (every one here, with AVX2), int8 ones for the K formats
    # elsewhere (quant_linear.activations_for):
    # greedy tokens agreeing before the first difference, 96 of 96 on the float path (an AMD
    # EPYC with AVX-512), 91 and 82 of 96 with int8 (a Xeon, that EPYC).
    assert all(
        p.activations == {f: activations_for(f) for f in p.formats}
        for p in packed
        if isinstance(p, QuantizedWeight)
    )
    agreeing = sum(
        next((i for i, (a, b) in enumerate(zip(exact, approx, strict=False)) if a != b), len(exact))
        for exact, approx in zip(answers["none"], answers["gguf"], strict=True)
    )
    assert agreeing >= 0.9 * sum(len(exact) for exact in answers["none"]), answers


@pytest.mark.real_model
@pytest.mark.parametrize("screened", [True, False])
def test_greedy_steps_never_hold_gemmas_whole_logits_and_choose_as_sampling_does(
    real_model, screened, monkeypatch
):
    """Rows wanting their argmax alone never hold the whole logits (sample/greedy): Gemma 3's
    262,144 tokens of its tied Q8_0 head screened by a cheaper product (bf16 on AMX, else
    int8), a slice at a time, where one runs (and `screened`), else in exact slices; the tokens
    are the sampler's path's, which logprobs take. 40 prompts: more rows than any CPU streams
    the head for."""
    if not screened:
        monkeypatch.setattr(quant_linear, "screen_product", lambda: None)
    elif quant_linear.screen_product() is None:
        pytest.skip("no screen runs on this CPU")
    llm = LLM(real_model("gemma-3-270m"), num_kv_blocks=256, quantization="gguf")
    model = llm.engine.runner.model
    asked: list[slice] = []
    whole_head = model.compute_logits

    def compute_logits(hidden: torch.Tensor, vocab: slice = slice(None)) -> torch.Tensor:
        asked.append(vocab)
        return whole_head(hidden, vocab)

    model.compute_logits = compute_logits
    screen = model.screen
    approximated: list[slice] = []
    approximate = screen.approximate

    def counted(x: torch.Tensor, part: slice, out=None) -> torch.Tensor:
        approximated.append(part)
        return approximate(x, part, out)

    monkeypatch.setattr(screen, "approximate", counted)
    prompts = [f"Fact {i}: the number {i} squared is" for i in range(40)]
    # Every step 40 rows: none ends early.
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    sliced = [v for v in asked if v != slice(None)]
    # 40 rows of float32 logits take slices of 8 MiB: 52,224 tokens (a multiple of 256)
    starts = range(0, 262144, 52224)
    if screened:  # the last slice cut at the vocabulary's end
        assert not asked and approximated
        assert {(v.start, v.stop) for v in approximated} == {
            (a, min(a + 52224, 262144)) for a in starts
        }
    else:
        assert not approximated
        assert sliced and {(v.start, v.stop) for v in sliced} == {(a, a + 52224) for a in starts}
    asked.clear()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    scored = llm.generate(prompts, params)
    assert asked and all(v == slice(None) for v in asked)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in scored]
