"""The adapters served on the model, each in a slot, and their matrices stacked per linear."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pagedbatch.engine.lora.adapter import LoraAdapter, load_adapter
from pagedbatch.engine.lora.linear import LoraLinear
from pagedbatch.engine.lora.mapping import BASE, LoraMapping, StepMapping


class ResidentLoras:
    """At most `max_loras` adapters, slot i holding `adapters[i]`; all of them resident from the
    start (none is swapped in or out)."""

    def __init__(self, adapters: Sequence[LoraAdapter], max_loras: int):
        if len(adapters) > max_loras:
            raise ValueError(
                f"lora_modules names {len(adapters)} adapters; max_loras is {max_loras}"
            )
        self.adapters = list(adapters)
        self.slots = {adapter.name: slot for slot, adapter in enumerate(self.adapters)}
        self.rank = max(adapter.rank for adapter in self.adapters)
        self.step = StepMapping()
        # (adapter, module) pairs no linear has taken yet: each must find one.
        self._unmatched = {(a.name, module) for a in self.adapters for module in a.weights}

    @classmethod
    def load(cls, paths: dict[str, Path], max_loras: int, max_rank: int) -> ResidentLoras:
        return cls([load_adapter(name, path, max_rank) for name, path in paths.items()], max_loras)

    def slot(self, name: str | None) -> int:
        return BASE if name is None else self.slots[name]

    def start_step(
        self, slots: Sequence[int], query_start_loc: Sequence[int], device: torch.device
    ) -> None:
        self.step.current = LoraMapping.of(slots, query_start_loc, device, len(self.adapters))

    def stack(
        self, parts: Sequence[str], sizes: Sequence[int], input_size: int, like: torch.Tensor
    ) -> LoraLinear | None:
        """The adapters of a linear whose output is `parts`' outputs (module paths, unfused)
        side by side, of `sizes` features each, on `like`'s device and dtype; None where no
        adapter targets any part."""
        rank, count = self.rank, len(self.adapters)
        a = torch.zeros(count, len(parts) * rank, input_size)
        b = torch.zeros(count, sum(sizes), len(parts) * rank)
        targeted = set()
        for slot, adapter in enumerate(self.adapters):
            offset = 0
            for i, (part, size) in enumerate(zip(parts, sizes, strict=True)):
                if (pair := adapter.weights.get(part)) is not None:
                    lora_a, lora_b = pair
                    if lora_a.shape[1] != input_size or lora_b.shape[0] != size:
                        raise ValueError(
                            f"LoRA adapter {adapter.name!r}: {part} is {lora_b.shape[0]}x"
                            f"{lora_a.shape[1]}, the model's is {size}x{input_size}"
                        )
                    a[slot, i * rank : i * rank + adapter.rank] = lora_a
                    b[slot, offset : offset + size, i * rank : i * rank + adapter.rank] = lora_b
                    targeted.add(slot)
                    self._unmatched.discard((adapter.name, part))
                offset += size
        if not targeted:
            return None
        to = {"device": like.device, "dtype": like.dtype}
        scalings = [adapter.scaling for adapter in self.adapters]
        return LoraLinear(a.to(**to), b.to(**to), scalings, targeted, self.step)

    def check_all_taken(self) -> None:
        """Every module an adapter targets found its linear in the model."""
        if self._unmatched:
            name, module = min(self._unmatched)
            raise ValueError(f"LoRA adapter {name!r} targets {module}, which this model lacks")
