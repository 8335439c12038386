"""Filling a model's parameters from a checkpoint's tensors, and checking that none is left out.

Each model maps the checkpoint's names onto its own (and onto the shard of a fused parameter:
q, k and v of one projection); what follows is the same for every model: the parameter's
`weight_loader` reads this rank's slice, an error names the checkpoint's tensor, and once the
checkpoint is read every parameter, every shard of a fused one, must have been filled.
"""

from __future__ import annotations

from torch import nn

from pagedbatch.engine.worker.parallel_layers import (
    ColumnParallelLinear,
    Loaded,
    default_weight_loader,
)


class ParameterLoads:
    """The parameters of `model` (a tied one once, under its first name) and which of their
    slots have been filled: a parameter has one slot, a fused one (a `ColumnParallelLinear` of
    several parts, or a module whose `parts_of(name)` says how many, as the experts of a
    mixture) one per part, named `name#part`."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())
        self.slots: set[str] = set()
        for name in self.params:
            owner_name, _, leaf = name.rpartition(".")
            parts = _parts(model.get_submodule(owner_name), leaf)
            self.slots |= {f"{name}#{i}" for i in range(parts)} if parts > 1 else {name}
        self._filled: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def load(self, ckpt_name: str, name: str, tensor: Loaded, shard: int | None = None) -> None:
        """Fills parameter `name` (its part `shard` of a fused one) from the checkpoint's
        tensor `ckpt_name`."""
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} {e}") from e
        self._filled.add(name if shard is None else f"{name}#{shard}")

    def check_complete(self, except_under: str | None = None) -> None:
        """Raises, naming the first few, unless every slot is filled; those under the prefix
        `except_under` aside (a part that checks its own loads)."""
        missing = sorted(
            slot
            for slot in self.slots - self._filled
            if except_under is None or not slot.startswith(except_under)
        )
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")


def _parts(owner: nn.Module, leaf: str) -> int:
    """How many parts `owner`'s parameter `leaf` loads in."""
    if isinstance(owner, ColumnParallelLinear):
        return len(owner.sizes)
    parts_of = getattr(owner, "parts_of", None)
    return 1 if parts_of is None else parts_of(leaf)
