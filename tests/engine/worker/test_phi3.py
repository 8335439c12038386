"""Phi-3: the engine's greedy output is token-identical to transformers' float32
`Phi3ForCausalLM` however requests are batched, cached or preempted; its fused q/k/v and gate/up
tensors split across two ranks as Llama's separate ones do."""

import pytest
import torch
from greedy_checks import (
    GREEDY,
    assert_greedy_matches_in_every_batching,
    assert_matches_oracle,
    random_prompts,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Phi3ForCausalLM

from pagedbatch.cli import main
from pagedbatch.engine import LLM


@pytest.fixture(scope="module")
def phi3(make_checkpoint):
    return make_checkpoint("phi3")


def test_greedy_output_matches_transformers_in_every_batching(phi3, oracle):
    assert_greedy_matches_in_every_batching(oracle, phi3)


def test_two_ranks_give_the_tokens_of_one(phi3):
    # Each rank reads its heads' rows of qkv_proj and its half of each of gate and up.
    prompts = [list(range(100, 140)), list(range(7, 12)), list(range(300, 390))]
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 64}
    expected = [o.token_ids for o in LLM(phi3, **args).generate(prompts, GREEDY)]
    llm = LLM(phi3, tensor_parallel_size=2, **args)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()


def test_longrope_is_refused_rather_than_ignored(make_checkpoint):
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
    with pytest.raises(ValueError, match="longrope"):
        LLM(make_checkpoint("phi3", rope_scaling=scaling), num_kv_blocks=16)


def test_make_model_writes_fused_tensors_transformers_phi3_loads(tmp_path):
    assert main(["make-model", "--arch", "phi3", str(tmp_path)]) == 0
    names = load_file(tmp_path / "model.safetensors")
    layer = {name.removeprefix("model.layers.0.") for name in names if ".layers.0." in name}
    assert {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"} <= layer
    assert not {"self_attn.q_proj.weight", "mlp.gate_proj.weight"} & layer
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model) is Phi3ForCausalLM
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()


def test_a_sliding_window_matches_transformers(make_checkpoint, oracle):
    # Phi-3-mini-4k slides every layer's window (2047 tokens); 16 here, inside the prompts.
    model_dir = make_checkpoint("phi3", sliding_window=16)
    prompts = random_prompts(3, 30, 60, seed=3)
    outputs = LLM(model_dir, num_kv_blocks=128).generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)
