"""Transformers as the oracle: its float32 greedy `generate` and log-softmax."""

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@cache
def _hf_model(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every request to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-softmax of the next-token distribution before each completion token."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture
def oracle():
    class Oracle:
        greedy = staticmethod(hf_greedy)
        logprobs = staticmethod(hf_logprobs)

    return Oracle
