"""A linear layer's adapters, stacked by slot, and the deltas they add to its product."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedbatch.engine.lora.mapping import StepMapping
from pagedbatch.kernels import lora, ops


class LoraLinear:
    """A linear's adapters: A `[slots, parts * R, in]` and B `[slots, out, parts * R]`, R the
    largest rank served, `max_lora_rank` (smaller ranks padded with zeros, which add nothing).
    A fused linear (q/k/v, gate/up) stacks its parts' A's and holds B block-diagonal over its
    output parts, so that one pair of matmuls serves all parts. Slots are written as adapters
    are swapped in (`write`), between steps.

    Rows of slot s get `scaling_s * (x @ A_s^T) @ B_s^T` added to the base product. A run of
    one adapter's rows (a prefill, see `LoraMapping`) takes two matmuls of its own; the other
    rows are gathered by slot so that one pair of batched matmuls serves every adapter present,
    a handful of torch calls a linear whatever the adapters' count, on CPU as on GPU."""

    def __init__(
        self,
        parts: Sequence[str],
        sizes: Sequence[int],
        input_size: int,
        slots: int,
        rank: int,
        like: torch.Tensor,
        step: StepMapping,
    ):
        self.parts, self.sizes, self.rank = list(parts), list(sizes), rank
        to = {"device": like.device, "dtype": like.dtype}
        self.a = torch.zeros(slots, len(parts) * rank, input_size, **to)
        # Stored rank-major, [slots, parts * R, out]: the second matmul reads each slot's B as
        # one contiguous matrix (a third faster on the CPU than its transpose).
        self.b = torch.zeros(slots, len(parts) * rank, sum(sizes), **to).transpose(1, 2)
        self.scalings = torch.zeros(slots, 1, 1, **to)
        self.targeted: set[int] = set()  # the slots whose adapter targets this linear
        self.step = step

    def write(
        self, slot: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scaling: float
    ) -> None:
        """Slot `slot` holds an adapter whose (A, B) for each part are `pairs` (None: that part
        is not targeted); all None empties the slot."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scalings[slot] = scaling
        self.targeted.discard(slot)
        offset = 0
        for i, (pair, size) in enumerate(zip(pairs, self.sizes, strict=True)):
            if pair is not None:
                lora_a, lora_b = pair
                r, at = lora_a.shape[0], i * self.rank
                self.a[slot, at : at + r].copy_(lora_a)
                self.b[slot, offset : offset + size, at : at + r].copy_(lora_b)
                self.targeted.add(slot)
            offset += size

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out`, the base product of `x` (rows of the step), with each row's delta added."""
        m = self.step.current
        if self.targeted.isdisjoint(m.slots):
            return out
        a, b, scalings = self.a, self.b, self.scalings
        lora.add_lora_runs(x, out, a, b, scalings, (r for r in m.runs if r.slot in self.targeted))
        if m.gather is None:
            return out
        # The torch pair of bmm calls on the CPU, Triton's kernels on CUDA (kernels.ops).
        return ops.add_lora(x, out, a, b, scalings, m.gather, m.valid, m.rows, m.width, m.subset)
