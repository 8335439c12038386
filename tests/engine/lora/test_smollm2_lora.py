"""Multi-LoRA on a trained model (issue 35): PEFT adapters made with peft on SmolLM2-135M-Instruct,
with random non-zero B matrices, ranks 8 and 16, targeting attention (q/k/v/o) and the MLP. The
engine's greedy output equals transformers + peft float32's for each adapter alone, and for 16
requests over 4 adapters and the base model in the same steps.

SmolLM2 ships as a Q4_1 GGUF, and LoRA is refused with quantization gguf (the adapters add to
float weights' products): so the engine serves the GGUF in exact mode (`quantization="none"`,
its blocks dequantized to float32), and transformers + peft runs transformers' own float32
dequantization of the same file, saved as a checkpoint so that peft can make and load adapters
on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import ATTENTION, MLP, make_adapter, peft_greedy
from real_models import CHATS
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# name: (rank, lora_alpha, targets, use_rslora). PEFT's random B (init_lora_weights=False) is
# large for a trained model; small alphas keep the answers those of a language model, changed.
ADAPTERS = {
    "all-r8": (8, 1, ATTENTION + MLP, False),
    "all-r16": (16, 1, ATTENTION + MLP, True),
    "attention-r16": (16, 2, ATTENTION, False),
    "mlp-qv-r8": (8, 4, ["q_proj", "v_proj", *MLP], False),
}


@pytest.fixture(scope="module")
def smollm2(real_model) -> Path:
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def dequantized(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' float32 dequantization of the GGUF as a checkpoint (it refuses to
    save_pretrained a GGUF-loaded model; its state dict and config are one): the LM head is
    the tied embeddings."""
    model = AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    )
    out = tmp_path_factory.mktemp("smollm2-float32")
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapters(dequantized: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_adapter(dequantized, tmp_path_factory.mktemp(name), *spec, seed=seed)
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def llm(smollm2: Path, adapters: dict[str, Path]) -> LLM:
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return LLM(
        smollm2,
        quantization="none",
        lora_modules=modules,
        max_loras=4,
        max_num_seqs=16,
        num_kv_blocks=128,
    )


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = llm.tokenizer.apply_chat_template(
            CHATS[i % len(CHATS)], tokenize=False, add_generation_prompt=True
        )
        prompts.append(llm.tokenizer.encode(text, add_special_tokens=False))
    return prompts


def test_quantization_gguf_refuses_the_adapters(smollm2: Path, adapters: dict[str, Path]):
    """Why the parity below runs exact mode: LoRA with the GGUF's blocks is not served yet."""
    name, path = next(iter(adapters.items()))
    with pytest.raises(ValueError, match="not served with quantization gguf"):
        LLM(smollm2, lora_modules=f"{name}={path}", num_kv_blocks=16)


def test_each_adapter_alone_matches_transformers_with_peft(llm, dequantized, adapters):
    prompts = chat_prompts(llm, 2)
    base = [peft_greedy(dequantized, None, p, MAX_TOKENS) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
    for name, path in adapters.items():
        outputs = llm.generate(prompts, GREEDY, lora_name=name)
        expected = [peft_greedy(dequantized, path, p, MAX_TOKENS) for p in prompts]
        assert [o.token_ids for o in outputs] == expected, name
        assert expected != base, f"{name} changes nothing: the test could not fail"


def test_sixteen_requests_over_four_adapters_and_the_base_in_the_same_steps(
    llm, dequantized, adapters
):
    prompts = chat_prompts(llm, 16)
    names = [None, *adapters]
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    outputs = llm.generate(prompts, GREEDY, lora_name=chosen)
    expected = [
        peft_greedy(dequantized, None if name is None else adapters[name], prompt, MAX_TOKENS)
        for name, prompt in zip(chosen, prompts, strict=True)
    ]
    assert [o.token_ids for o in outputs] == expected
