"""Trained GGUF checkpoints served as they are: greedy chat answers equal transformers' own GGUF
loading of the same file, token for token, ending on the model's own end token."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model

MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one sentence."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "What is 12 times 12?"}],
    [{"role": "user", "content": "Name a primary colour."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Is the sun a star? Answer yes or no."}],
    [SYSTEM, {"role": "user", "content": "Why is the sky blue?"}],
    [SYSTEM, {"role": "user", "content": "What do bees make?"}],
    [
        {"role": "system", "content": "You only answer in French."},
        {"role": "user", "content": "Hello!"},
    ],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [
        {"role": "user", "content": "Give me a number between 1 and 10."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Now double it."},
    ],
    [
        SYSTEM,
        {"role": "user", "content": "What is water made of?"},
        {"role": "assistant", "content": "Hydrogen and oxygen."},
        {"role": "user", "content": "And salt?"},
    ],
]

# Gemma 3 270M is a base model: its GGUF has no chat template, so it runs under Gemma's turn
# format, given as the chat_template setting.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ '<start_of_turn>user\\n' + m['content'] + '\\n' }}{% continue %}{% endif %}"
    "{% if m['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == "
    "'system' %}{{ m['content'] + '<end_of_turn>\\n' }}{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + "
    "m['content'] + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
MODELS = {"smollm2-135m-instruct": None, "gemma-3-270m": GEMMA_TEMPLATE}


@cache
def _transformers_model(gguf_file: Path):
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def transformers_greedy(gguf_file: Path, prompt: list[int], eos: list[int]) -> list[int]:
    model = _transformers_model(gguf_file)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, real_model) -> tuple[Path, LLM]:
    gguf_file = real_model(request.param)
    return gguf_file, LLM(gguf_file, num_kv_blocks=512, chat_template=MODELS[request.param])


def chat_prompt(llm: LLM, chat: list[dict[str, str]]) -> list[int]:
    """The prompt's ids as the chat endpoint makes them: the template adds any special tokens."""
    text = llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chats_equal_transformers_and_end_on_the_models_end_token(served):
    gguf_file, llm = served
    eos = sorted(llm.engine.eos_token_ids)
    prompts = [chat_prompt(llm, chat) for chat in CHATS]
    outputs = [request.outputs[0] for request in llm.generate(prompts, GREEDY)]
    for chat, prompt, output in zip(CHATS, prompts, outputs, strict=True):
        assert output.token_ids == transformers_greedy(gguf_file, prompt, eos), chat
        if output.finish_reason == "stop":
            assert output.token_ids[-1] in eos
    assert sum(o.finish_reason == "stop" for o in outputs) >= len(CHATS) // 2
    assert "Paris" in outputs[0].text
