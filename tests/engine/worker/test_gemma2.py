"""Gemma 2: the engine's greedy output is token-identical to transformers' float32
`Gemma2ForCausalLM` however requests are batched, cached or preempted, past the sliding window of
its alternate layers; its soft-capped logits give transformers' logprobs.

The tiny checkpoint's caps (5 on attention scores, 30 on logits) change what it computes (see
make_model), and its window (64) is shorter than the longer prompts."""

import json

import pytest
import torch
from greedy_checks import GREEDY, assert_greedy_matches_in_every_batching, random_prompts
from transformers import AutoModelForCausalLM, Gemma2ForCausalLM

from pagedbatch.cli import main
from pagedbatch.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def gemma2(make_checkpoint):
    return make_checkpoint("gemma2")


def test_greedy_output_matches_transformers_in_every_batching(gemma2, oracle):
    assert_greedy_matches_in_every_batching(oracle, gemma2)


def test_logprobs_are_transformers_log_softmax_of_the_capped_logits(gemma2, oracle):
    prompt = random_prompts(1, 100, 100, seed=8)[0]
    llm = LLM(gemma2, num_kv_blocks=64)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    expected = oracle.logprobs(gemma2, prompt, out.token_ids)
    for row, entry, token in zip(expected, out.logprobs, out.token_ids, strict=True):
        assert abs(entry.logprob - row[token].item()) < 1e-4
        assert [t for t, _ in entry.top] == torch.topk(row, 5).indices.tolist()


def test_two_ranks_give_the_tokens_of_one(gemma2):
    # Each rank soft-caps its own heads' scores; the LM head's logits are capped once gathered.
    prompts = [list(range(100, 140)), list(range(7, 12)), list(range(300, 390))]
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 64}
    expected = [o.token_ids for o in LLM(gemma2, **args).generate(prompts, GREEDY)]
    llm = LLM(gemma2, tensor_parallel_size=2, **args)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()


@torch.inference_mode()
def test_the_tiny_checkpoints_attention_cap_changes_its_output(gemma2):
    prompt = torch.tensor([random_prompts(1, 90, 90, seed=3)[0]])
    outputs = []
    for cap in (5.0, None):
        model = AutoModelForCausalLM.from_pretrained(gemma2, attn_logit_softcapping=cap)
        outputs.append(model.generate(prompt, max_new_tokens=16, do_sample=False).tolist())
    assert outputs[0] != outputs[1]


def test_configs_without_layer_types_alternate_as_gemma2_was_released(make_checkpoint, oracle):
    model_dir = make_checkpoint("gemma2", layer_types=None)
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    prompts = random_prompts(3, 70, 120, seed=7)
    outputs = LLM(model_dir, num_kv_blocks=128).generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == oracle.greedy(model_dir, prompt, GREEDY.max_tokens)


def test_make_model_writes_what_transformers_gemma2_loads(tmp_path):
    assert main(["make-model", "--arch", "gemma2", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["query_pre_attn_scalar"] != config["head_dim"]  # so a wrong scale shows
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model) is Gemma2ForCausalLM
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert model.lm_head.weight is model.model.embed_tokens.weight
