"""The trained models the real-model tests serve, the chats they ask, and the oracle: transformers'
own GGUF loading of the same file, greedy, in float32.

The oracle's answers are kept on disk beside the models, one file per answer, keyed by everything
that decides it (the GGUF file's path, size and modification time, the transformers and torch
versions, the prompt, the end tokens and the length): transformers loads a GGUF and generates far
slower than we do, and re-asking it the same question on an unchanged machine learns nothing.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from pagedbatch.engine.worker.gguf import cache_root
from pagedbatch.pypi_models import GEMMA_TURNS

ORACLE_ANSWERS = cache_root().parent / "oracle"

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

# name in pagedbatch.pypi_models -> the chat_template setting it runs with (Gemma 3 270M is a
# base model: its GGUF has none)
MODELS = {"smollm2-135m-instruct": None, "gemma-3-270m": GEMMA_TURNS}
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


def transformers_greedy(gguf_file: Path, prompt: list[int], eos: list[int]) -> list[int]:
    stat = gguf_file.stat()
    question = [
        str(gguf_file.resolve()), stat.st_size, stat.st_mtime_ns,
        transformers.__version__, torch.__version__, prompt, eos, MAX_TOKENS,
    ]  # fmt: skip
    digest = hashlib.sha256(json.dumps(question).encode()).hexdigest()[:32]
    answer = ORACLE_ANSWERS / f"{gguf_file.stem}-{digest}.json"
    if answer.is_file():
        return json.loads(answer.read_text())
    tokens = _generate(gguf_file, prompt, eos)
    answer.parent.mkdir(parents=True, exist_ok=True)
    staging = answer.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(tokens))
    staging.replace(answer)
    return tokens


@torch.inference_mode()
def _generate(gguf_file: Path, prompt: list[int], eos: list[int]) -> list[int]:
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
