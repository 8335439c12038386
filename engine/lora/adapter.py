"""A LoRA adapter as PEFT saves it: `adapter_config.json` and `adapter_model.safetensors`.

PEFT adds `scaling * B(A(x))` to a target linear's output, `A` being `[r, in]` and `B`
`[out, r]`, with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` under `use_rslora`).
What PEFT can save beyond that (DoRA, trained biases, whole modules, per-module ranks) is refused
by name rather than served wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# The linears an adapter may target, by the name transformers gives them in a Llama-style layer.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # By module path as the model names its unfused linears ("layers.0.self_attn.q_proj"):
    # (A `[r, in]`, B `[out, r]`), float32.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: Path, max_rank: int) -> LoraAdapter:
    """The adapter in PEFT folder `path`; ValueError naming what it holds that is not served."""
    where = f"LoRA adapter {name!r} ({path})"
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(path / WEIGHTS_FILE)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a PEFT adapter folder: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r}, not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ValueError(f"{where}: r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    if refused := [key for key, used in unsupported.items() if used]:
        raise ValueError(f"{where}: {', '.join(refused)} not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraAdapter(name, rank, scaling, _pairs(where, tensors, rank))


def _pairs(
    where: str, tensors: dict[str, torch.Tensor], rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (A, B) pair of each module, checked: every tensor a pair's, of rank `rank`."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, dot, half = key.removesuffix(".weight").rpartition(".")
        if not dot or half not in ("lora_A", "lora_B"):
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A or B matrix")
        module = module.removeprefix("base_model.model.").removeprefix("model.")
        if module.rpartition(".")[2] not in TARGET_MODULES:
            raise ValueError(
                f"{where}: targets {module!r}; served targets are {', '.join(TARGET_MODULES)}"
            )
        halves.setdefault(module, {})[half] = tensor.float()
    pairs = {}
    for module, found in halves.items():
        a, b = found.get("lora_A"), found.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"{where}: {module} needs a 2-D lora_A and lora_B")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: {module}'s matrices are not of rank {rank}")
        pairs[module] = (a, b)
    return pairs
