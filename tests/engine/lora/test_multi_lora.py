"""Multi-LoRA (issue 35): PEFT adapters on a tiny Llama, with random non-zero B matrices, ranks 8
and 16, targeting attention (q/k/v/o) and the MLP. The engine's greedy output equals
transformers + peft float32's for each adapter alone, and for requests of several adapters and
the base model in the same steps; prefix-cache blocks are not shared across adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy_checks import GREEDY, random_prompts
from lora_adapters import ATTENTION, MLP, make_adapter
from lora_adapters import peft_greedy as oracle_greedy

from pagedbatch.engine import LLM

# name: (rank, lora_alpha, targets, use_rslora)
ADAPTERS = {
    "all-r8": (8, 16, ATTENTION + MLP, False),
    "all-r16": (16, 8, ATTENTION + MLP, True),
    "attention-r16": (16, 32, ATTENTION, False),
    "mlp-qv-r8": (8, 8, ["q_proj", "v_proj", *MLP], False),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_adapter(tiny_llama, tmp_path_factory.mktemp(name), *spec, seed=seed)
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    return oracle_greedy(model_dir, adapter, prompt, GREEDY.max_tokens)


def serving(model_dir: Path, adapters: dict[str, Path], **args) -> LLM:
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return LLM(model_dir, lora_modules=modules, max_loras=4, num_kv_blocks=256, **args)


def test_each_adapter_alone_matches_transformers_with_peft(tiny_llama, adapters):
    llm = serving(tiny_llama, adapters)
    prompts = random_prompts(2, 5, 40, seed=11)
    base = [peft_greedy(tiny_llama, None, prompt) for prompt in prompts]
    for name, path in adapters.items():
        outputs = llm.generate(prompts, GREEDY, lora_name=name)
        expected = [peft_greedy(tiny_llama, path, prompt) for prompt in prompts]
        assert [o.token_ids for o in outputs] == expected, name
        assert expected != base, f"{name} changes nothing: the test could not fail"


def test_sixteen_requests_over_four_adapters_and_the_base_in_the_same_steps(tiny_llama, adapters):
    llm = serving(tiny_llama, adapters, max_num_seqs=16)
    prompts = random_prompts(16, 3, 50, seed=12)
    names = [None, *adapters]
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    outputs = llm.generate(prompts, GREEDY, lora_name=chosen)
    expected = [
        peft_greedy(tiny_llama, None if name is None else adapters[name], prompt)
        for name, prompt in zip(chosen, prompts, strict=True)
    ]
    assert [o.token_ids for o in outputs] == expected


def test_the_prefix_cache_is_not_shared_across_adapters(tiny_llama, adapters):
    llm = serving(tiny_llama, adapters)
    prompt = random_prompts(1, 40, 40, seed=13)[0]  # two full blocks of 16 tokens
    first, second = list(adapters)[:2]
    llm.generate([prompt], GREEDY, lora_name=first)
    assert llm.generate([prompt], GREEDY, lora_name=first)[0].num_cached_tokens == 32
    other = llm.generate([prompt], GREEDY, lora_name=second)[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert other.num_cached_tokens == base.num_cached_tokens == 0
    assert other.token_ids == peft_greedy(tiny_llama, adapters[second], prompt)
    assert base.token_ids == peft_greedy(tiny_llama, None, prompt)


def test_an_unknown_adapter_is_refused_by_name(tiny_llama, adapters):
    llm = serving(tiny_llama, adapters)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; served: all-r8"):
        llm.generate([[1, 2, 3]], GREEDY, lora_name="nope")
