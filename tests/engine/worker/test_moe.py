"""Mixtures of experts (Mixtral, Qwen3-MoE): the engine's greedy output is token-identical to
transformers' float32 model however requests are batched, cached or preempted, and on two
ranks as on one. The tiny checkpoints route a prompt's tokens to every expert; Mixtral
renormalises its top-2 probabilities and the tiny Qwen3-MoE does not (norm_topk_prob false)."""

import shutil

import pytest
import torch
from greedy_checks import GREEDY, assert_greedy_matches_in_every_batching, random_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedbatch.cli import main
from pagedbatch.engine import LLM

ARCHS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=list(ARCHS))
def moe(request, make_checkpoint):
    return make_checkpoint(request.param)


def test_greedy_output_matches_transformers_in_every_batching(moe, oracle):
    assert_greedy_matches_in_every_batching(oracle, moe)


def test_two_ranks_give_the_tokens_of_one(moe):
    # Each rank holds half of every expert's intermediate features and the whole router.
    prompts = [list(range(100, 140)), list(range(7, 12)), list(range(300, 390))]
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 64}
    expected = [o.token_ids for o in LLM(moe, **args).generate(prompts, GREEDY)]
    llm = LLM(moe, tensor_parallel_size=2, **args)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()


@torch.inference_mode()
def test_the_tiny_checkpoints_route_a_prompt_to_every_expert(moe):
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    ids = torch.tensor([random_prompts(1, 60, 60, seed=1)[0]])
    out = model(ids, output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    for logits in out.router_logits:
        chosen = logits.topk(top_k, dim=-1).indices
        assert set(chosen.flatten().tolist()) == set(range(logits.shape[-1]))


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"), "experts.w13#5"),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.8.up_proj.weight": torch.ones(128, 128)}
            ),
            "names expert 8",
        ),
    ],
    ids=["missing", "beyond"],
)
def test_missing_experts_and_experts_beyond_the_config_are_named(
    make_checkpoint, tmp_path, edit, error
):
    source = make_checkpoint("qwen3_moe")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=error):
        LLM(tmp_path, num_kv_blocks=16)


def test_qwen3_moe_with_dense_layers_is_refused(make_checkpoint):
    with pytest.raises(ValueError, match="mlp_only_layers"):
        LLM(make_checkpoint("qwen3_moe", mlp_only_layers=[1]), num_kv_blocks=16)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_make_model_writes_what_transformers_loads(tmp_path, arch):
    assert main(["make-model", "--arch", arch, str(tmp_path)]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == ARCHS[arch]
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
