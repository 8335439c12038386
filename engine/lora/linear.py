"""A linear layer's adapters, stacked by slot, and the deltas they add to its product."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pagedbatch.engine.lora.mapping import StepMapping
from pagedbatch.kernels import ops


class LoraLinear:
    """A linear's adapters: A `[slots, parts * R, in]` and B `[slots, out, parts * R]`, R the
    largest rank served (smaller ranks padded with zeros, which add nothing). A fused linear
    (q/k/v, gate/up) stacks its parts' A's and holds B block-diagonal over its output parts,
    so that one pair of matmuls serves all parts.

    Rows of slot s get `scaling_s * (x @ A_s^T) @ B_s^T` added to the base product. The step's
    rows are gathered by slot (see `LoraMapping`) so that one pair of batched matmuls serves
    every adapter present: a handful of torch calls a linear whatever the adapters' count, on
    CPU as on GPU. On bench-small-llama (2 CPU cores), 128 requests of 16 prompt and 64 output
    tokens over 8 rank-16 adapters of all seven targets took 1.20x the base model's time alone,
    where a pair of matmuls per adapter present took 1.38x; with 64-token prompts and 32 output
    tokens, 1.22x either way (prefill's matmuls are large enough)."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scalings: Sequence[float],
        targeted: Collection[int],
        step: StepMapping,
    ):
        self.a, self.b = a, b
        self.scalings = torch.tensor(scalings, dtype=a.dtype, device=a.device).view(-1, 1, 1)
        self.targeted = frozenset(targeted)  # the slots whose adapter targets this linear
        self.step = step

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out`, the base product of `x` (rows of the step), with each row's delta added."""
        m = self.step.current
        if self.targeted.isdisjoint(m.slots):
            return out
        # The torch pair of bmm calls on the CPU, Triton's kernels on CUDA (kernels.ops).
        a, b, scalings = self.a, self.b, self.scalings
        return ops.add_lora(x, out, a, b, scalings, m.gather, m.valid, m.rows, m.width, m.subset)
