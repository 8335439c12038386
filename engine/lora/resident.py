"""The adapters resident on the model's device, each in one of `max_loras` slots, and their
matrices stacked per linear.

vLLM's scheme: `max_loras` adapters at most in one step (the scheduler sees to it), each in a
slot of every adapted linear; an adapter a step needs that is not resident takes a free slot,
or else the least recently used slot of an adapter that step does not need, its matrices copied
in from host memory (`LoraRegistry`) before the step runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

from pagedbatch.engine.lora.linear import LoraLinear
from pagedbatch.engine.lora.mapping import BASE, CPU_MIN_RUN, LoraMapping, StepMapping
from pagedbatch.engine.lora.registry import LoraRegistry, Registered


class ResidentLoras:
    def __init__(self, max_loras: int, max_cpu_loras: int, max_rank: int):
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})"
            )
        self.max_loras = max_loras
        self.rank = max_rank
        self.registry = LoraRegistry(max_cpu_loras, max_rank)
        self.step = StepMapping()
        self.linears: list[LoraLinear] = []
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self._free = list(range(max_loras))
        self.swaps = 0  # adapters copied into a slot

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters registered, in the order they were."""
        return tuple(self.registry.registered)

    def lora_id(self, name: str) -> int:
        return self.registry.registered[name].lora_id

    def resident(self) -> dict[str, int]:
        """The adapters in a slot, by name."""
        return dict(self._slots)

    def adapt(
        self, parts: Sequence[str], sizes: Sequence[int], input_size: int, like: torch.Tensor
    ) -> LoraLinear:
        """The slots of a linear whose output is `parts`' outputs (module paths, unfused) side
        by side, of `sizes` features each, on `like`'s device and dtype."""
        linear = LoraLinear(parts, sizes, input_size, self.max_loras, self.rank, like, self.step)
        self.linears.append(linear)
        shapes = dict(self.registry.shapes)
        shapes.update({part: (input_size, size) for part, size in zip(parts, sizes, strict=True)})
        self.registry.shapes = shapes
        return linear

    def load(self, name: str, path: Path) -> Registered:
        """Reads and registers the adapter at `path` (ValueError naming what is wrong)."""
        return self.registry.add(self.registry.read(name, path), path)

    def remove(self, name: str) -> None:
        """Unregisters `name` and empties its slot (KeyError: not registered). Its requests
        must be gone: the engine sees to that."""
        self.registry.remove(name)
        slot = self._slots.pop(name, None)
        if slot is not None:
            for linear in self.linears:
                linear.write(slot, [None] * len(linear.parts), 0.0)
            self._free.append(slot)

    def prepare(self, names: Collection[str]) -> dict[str, str]:
        """Makes the adapters of a step (at most `max_loras`) resident. Returns, by name, why
        any could not be: its folder, read again, failed (it is unregistered then)."""
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} adapters in one step; max_loras is {self.max_loras}")
        failed = {}
        for name in names:
            if name in self._slots:
                self._slots.move_to_end(name)
        for name in names:
            if name in self._slots:
                continue
            if name not in self.registry.registered:  # its folder failed in an earlier step
                failed[name] = f"LoRA adapter {name!r} is no longer loaded"
                continue
            try:
                adapter = self.registry.adapter(name, keep=names)
            except ValueError as e:
                failed[name] = str(e)
                self.registry.remove(name)
                continue
            if self._free:
                slot = self._free.pop(0)
            else:  # the least recently used adapter this step does not need
                evicted = next(n for n in self._slots if n not in names)
                slot = self._slots.pop(evicted)
            for linear in self.linears:
                pairs = [adapter.weights.get(part) for part in linear.parts]
                linear.write(slot, pairs, adapter.scaling)
            self._slots[name] = slot
            self.swaps += 1
        return failed

    def slot(self, name: str | None) -> int:
        return BASE if name is None else self._slots[name]

    def start_step(
        self, slots: Sequence[int], query_start_loc: Sequence[int], device: torch.device
    ) -> None:
        min_run = CPU_MIN_RUN if device.type == "cpu" else None
        self.step.current = LoraMapping.of(slots, query_start_loc, device, self.max_loras, min_run)
