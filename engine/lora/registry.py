"""The LoRA adapters registered with the engine, by name, and those kept in host memory.

Registering reads and checks an adapter's folder (`adapter.load_adapter`); its tensors are kept
in host memory while it is among the `max_cpu_loras` most recently used. One that falls out is
read from its folder again the next time a step needs it, and checked again: should the folder
have changed for the worse, that read fails and its requests with it (see `ResidentLoras`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedbatch.engine.lora.adapter import LoraAdapter, load_adapter


class UnknownLora(LookupError):
    """No adapter of that name is loaded."""


class LoraNameError(ValueError):
    """The name is not one an adapter may take: taken, or the model's own."""


class LoraInUse(RuntimeError):
    """The adapter has requests that have not finished."""


@dataclass(frozen=True)
class Registered:
    path: Path
    # Unique to this registration: a name unloaded and loaded again, perhaps with other
    # weights, is another adapter to the prefix cache (see Request.lora_key).
    lora_id: int


class LoraRegistry:
    def __init__(self, max_cpu_loras: int, max_rank: int):
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        # The model's adaptable linears, `(in, out)` by unfused module path (set once the model
        # is built: see worker.lora_linears).
        self.shapes: Mapping[str, tuple[int, int]] = {}
        self.registered: dict[str, Registered] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self.reads = 0  # folders read, registrations included

    def read(self, name: str, path: Path) -> LoraAdapter:
        """The adapter in `path`, checked against the model (safe off the engine thread)."""
        adapter = load_adapter(name, path, self.max_rank, self.shapes)
        self.reads += 1
        return adapter

    def add(self, adapter: LoraAdapter, path: Path) -> Registered:
        """Registers `adapter`, read from `path`; ValueError where its name is taken."""
        if adapter.name in self.registered:
            raise LoraNameError(f"LoRA adapter {adapter.name!r} is already loaded")
        registered = Registered(path, next(self._ids))
        self.registered[adapter.name] = registered
        self._keep(adapter, keep=())
        return registered

    def remove(self, name: str) -> None:
        del self.registered[name]
        self._host.pop(name, None)

    def in_host_memory(self, name: str) -> bool:
        return name in self._host

    def adapter(self, name: str, keep: Collection[str]) -> LoraAdapter:
        """Registered adapter `name`'s tensors: from host memory, or read from its folder again
        (ValueError where that fails), evicting the least recently used not in `keep`."""
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        adapter = self.read(name, self.registered[name].path)
        self._keep(adapter, keep)
        return adapter

    def _keep(self, adapter: LoraAdapter, keep: Collection[str]) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        for name in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                break
            if name != adapter.name and name not in keep:
                del self._host[name]
