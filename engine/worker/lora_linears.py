"""Which of a model's linears take which modules of the LoRA adapters served.

Adapters name the linears as transformers has them (`layers.0.self_attn.q_proj`); the model
fuses some of them (its `_FUSED`: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`), and such
a linear takes its parts' adapters stacked (see `lora.linear.LoraLinear`).
"""

from __future__ import annotations

from torch import nn

from pagedbatch.engine.lora.adapter import TARGET_MODULES
from pagedbatch.engine.lora.resident import ResidentLoras
from pagedbatch.engine.worker.parallel_layers import ColumnParallelLinear, RowParallelLinear


def attach_loras(model: nn.Module, loras: ResidentLoras) -> None:
    """Gives each linear of `model` its adapter slots, before its weights are packed (a
    row-parallel linear's output size is read off its weight). Adapters are loaded after: their
    modules are checked against the linears (`loras.registry.shapes`) before anything of theirs
    is allocated."""
    fused: dict[str, tuple[str, int]] = getattr(type(model), "_FUSED", {})
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear):
            parts, sizes = _parts(name, fused, len(module.sizes)), module.sizes
        elif isinstance(module, RowParallelLinear):
            parts, sizes = [name], [module.weight.shape[0]]
        else:
            continue
        if not any(part.rpartition(".")[2] in TARGET_MODULES for part in parts):
            continue  # no adapter may target it (an LM head)
        module.lora = loras.adapt(parts, sizes, module.input_size, module.weight)


def _parts(name: str, fused: dict[str, tuple[str, int]], count: int) -> list[str]:
    """The unfused module paths of linear `name`'s `count` output parts, in order."""
    prefix, _, last = name.rpartition(".")
    held = sorted((index, part) for part, (into, index) in fused.items() if into == last)
    if len(held) != count:
        return [name] if count == 1 else [f"{name}[{i}]" for i in range(count)]
    return [f"{prefix}.{part}" for _, part in held]
