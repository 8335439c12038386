"""Gemma 3 (text only): the engine's greedy output is token-identical to transformers' float32
`Gemma3ForCausalLM` past the sliding window, whole and chunked. (test_llm.py runs its batching,
chunked-prefill, prefix-caching and preemption tests on Gemma 3 too.)

The tiny checkpoint has four layers, three sliding (a window of 64) then one full, each kind with
its own RoPE base; see make_model.
"""

import json
import shutil

import pytest
import torch
from greedy_checks import GREEDY, assert_matches_oracle, random_prompts
from native_bf16 import needs_native_bf16
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM
from transformers.activations import ACT2FN

from pagedbatch.cli import main
from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.worker.models.gemma3 import (
    FULL,
    SLIDING,
    gelu_tanh_and_mul,
    layer_types,
    rope_parameters_by_layer_type,
)

WINDOW = 64


@pytest.fixture(scope="module")
def gemma3(make_checkpoint):
    return make_checkpoint("gemma3")


def test_the_tiny_checkpoint_has_both_layer_kinds_and_a_window_tests_pass(gemma3):
    config = json.loads((gemma3 / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL]
    assert config["sliding_window"] == WINDOW
    assert config["query_pre_attn_scalar"] != config["head_dim"]  # so a wrong scale shows


def test_prompts_and_outputs_past_the_sliding_window_match(gemma3, oracle):
    # Prompts from under the window to twice it, generated well past it, prefilled whole and in
    # chunks that start inside the window and beyond it.
    prompts = random_prompts(4, WINDOW - 10, 2 * WINDOW, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for budget in (2048, 24):
        llm = LLM(gemma3, num_kv_blocks=256, max_num_batched_tokens=budget)
        outputs = llm.generate(prompts, params)
        assert_matches_oracle(oracle, gemma3, prompts, outputs, max_tokens=48)


def test_logprobs_agree_with_transformers_log_softmax(gemma3, oracle):
    prompt = random_prompts(1, 100, 100, seed=8)[0]
    llm = LLM(gemma3, num_kv_blocks=64)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    expected = oracle.logprobs(gemma3, prompt, out.token_ids)
    for row, entry, token in zip(expected, out.logprobs, out.token_ids, strict=True):
        assert abs(entry.logprob - row[token].item()) < 1e-4
        assert [t for t, _ in entry.top] == torch.topk(row, 5).indices.tolist()


def test_the_mlp_activation_is_transformers_gelu_pytorch_tanh_bitwise():
    gate_up = torch.randn(7, 2 * 384, generator=torch.Generator().manual_seed(0)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate.contiguous()) * up
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up), expected, atol=0, rtol=0)


@needs_native_bf16
@torch.inference_mode()
def test_bfloat16_rounds_as_transformers_does(gemma3):
    # Gemma's norms compute in float32 and round once; rounding the normalised rows to bfloat16
    # before scaling them (Llama's norm) made these diverge within a few tokens.
    prompts = random_prompts(4, 20, 150, seed=9)
    outputs = LLM(gemma3, num_kv_blocks=128, dtype="bfloat16").generate(prompts, GREEDY)
    model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.bfloat16).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert output.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"), "k_norm"),
        (lambda t: t.update({"model.layers.0.self_attn.z_norm.weight": torch.ones(32)}), "z_norm"),
    ],
    ids=["missing", "unknown"],
)
def test_missing_and_unknown_tensors_are_named(gemma3, tmp_path, edit, error):
    shutil.copytree(gemma3, tmp_path, dirs_exist_ok=True)
    tensors = load_file(gemma3 / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=error):
        LLM(tmp_path, num_kv_blocks=16)


def test_older_configs_rope_and_layer_pattern_match_transformers(make_checkpoint, oracle):
    # Gemma 3 as first released: no layer_types or rope_parameters, but a layer pattern, two RoPE
    # bases and rope_scaling (for the full layers only). Every other layer full here.
    model_dir = make_checkpoint(
        "gemma3",
        layer_types=None,
        sliding_window_pattern=2,
        rope_parameters=None,
        rope_theta=50_000.0,
        rope_local_base_freq=2_000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    hf_config = AutoModelForCausalLM.from_pretrained(model_dir).config
    raw = json.loads((model_dir / "config.json").read_text())
    assert layer_types(raw) == hf_config.layer_types == [SLIDING, FULL, SLIDING, FULL]
    ours = rope_parameters_by_layer_type(raw)
    for kind in (SLIDING, FULL):
        assert ours[kind] == hf_config.rope_parameters[kind]
    prompts = random_prompts(3, 50, 100, seed=7)
    outputs = LLM(model_dir, num_kv_blocks=128).generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)


@pytest.mark.parametrize(
    "override",
    [
        {"final_logit_softcapping": 30.0},
        {"attn_logit_softcapping": 50.0},
        {"use_bidirectional_attention": True},
        {"hidden_activation": "silu"},
    ],
    ids=lambda o: next(iter(o)),
)
def test_settings_it_does_not_implement_are_refused(make_checkpoint, override):
    with pytest.raises(ValueError, match=next(iter(override))):
        LLM(make_checkpoint("gemma3", **override), num_kv_blocks=16)


def test_two_ranks_give_the_tokens_of_one(gemma3):
    # Four query heads and two key/value heads: each rank holds two and one, and q_norm/k_norm
    # (over head_dim) whole.
    prompts = [list(range(100, 140)), list(range(7, 12)), list(range(300, 390))]
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 64}
    expected = [o.token_ids for o in LLM(gemma3, **args).generate(prompts, GREEDY)]
    llm = LLM(gemma3, tensor_parallel_size=2, **args)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()


def test_make_model_writes_what_transformers_gemma3_loads(tmp_path, capsys):
    assert main(["make-model", "--arch", "gemma3", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    model, info = Gemma3ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is Gemma3ForCausalLM
