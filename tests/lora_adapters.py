"""LoRA adapters made with peft on a checkpoint, and transformers + peft as their oracle.

A module of its own (not conftest.py), as greedy_checks is, so test modules import it by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    rank: int,
    alpha: int,
    targets: list[str],
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A PEFT adapter folder saved by peft itself; `init_lora_weights=False` draws B at random
    too (PEFT's default starts it at zero, an adapter that changes nothing)."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    get_peft_model(_base(model_dir), config).save_pretrained(out_dir)
    return out_dir


@functools.cache
def _oracle(model_dir: Path, adapter: Path | None) -> torch.nn.Module:
    model = _base(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def peft_greedy(
    model_dir: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int
) -> list[int]:
    """transformers + peft float32 greedy tokens after `prompt` (adapter None: the base)."""
    ids = torch.tensor([prompt])
    out = _oracle(model_dir, adapter).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()
