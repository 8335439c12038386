"""The trained models the real-model tests serve, the chats they ask, and the oracle: transformers'
own GGUF loading of the same file, greedy, in float32.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

MAX_TOKENS = 32

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
# name in pagedbatch.pypi_models -> the chat_template setting it runs with
MODELS = {"smollm2-135m-instruct": None, "gemma-3-270m": GEMMA_TEMPLATE}
# Tuned to chat: these answer questions and end their turns. A base model continues text (asked
# "What is the capital of France?" in a chat, Gemma 3 270M repeats the question), so only its
# tokens are checked, and its knowledge through a completion prompt.
INSTRUCT = {"smollm2-135m-instruct"}
FEW_SHOT_FRANCE = (
    "Q: What is the capital of Germany?\nA: Berlin\nQ: What is the capital of Italy?\nA: Rome\n"
    "Q: What is the capital of France?\nA:"
)


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
