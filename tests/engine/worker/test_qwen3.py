"""Qwen3: the engine's greedy output is token-identical to transformers' float32
`Qwen3ForCausalLM` however requests are batched, cached or preempted. The tiny checkpoint's q/k
norms have random scales: an engine that skipped them, or applied them after RoPE, would
diverge."""

import torch
from greedy_checks import (
    GREEDY,
    assert_greedy_matches_in_every_batching,
    assert_matches_oracle,
    random_prompts,
)
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from pagedbatch.cli import main
from pagedbatch.engine import LLM


def test_greedy_output_matches_transformers_in_every_batching(make_checkpoint, oracle):
    assert_greedy_matches_in_every_batching(oracle, make_checkpoint("qwen3"))


def test_make_model_writes_what_transformers_qwen3_loads(tmp_path):
    assert main(["make-model", "--arch", "qwen3", str(tmp_path)]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model) is Qwen3ForCausalLM
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert model.model.layers[0].self_attn.q_norm.weight.std() > 0.1


def test_a_sliding_window_from_max_window_layers_on_matches_transformers(make_checkpoint, oracle):
    model_dir = make_checkpoint("qwen3", use_sliding_window=True, sliding_window=16)
    prompts = random_prompts(3, 30, 60, seed=3)
    outputs = LLM(model_dir, num_kv_blocks=128).generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)
