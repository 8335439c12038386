"""A linear layer's adapters, stacked by slot, and the deltas they add to its product."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pagedbatch.engine.lora.mapping import StepMapping


class LoraLinear:
    """A linear's adapters: A `[slots, parts * R, in]` and B `[slots, out, parts * R]`, R the
    largest rank served (smaller ranks padded with zeros, which add nothing). A fused linear
    (q/k/v, gate/up) stacks its parts' A's and holds B block-diagonal over its output parts,
    so that one pair of matmuls serves all parts.

    Rows of slot s get `scaling_s * (x @ A_s^T) @ B_s^T` added to the base product: one pair of
    small matmuls per adapter present in the step (torch's, on CPU as on GPU)."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scalings: Sequence[float],
        targeted: Collection[int],
        step: StepMapping,
    ):
        self.a, self.b = a, b
        self.scalings = list(scalings)
        self.targeted = frozenset(targeted)  # the slots whose adapter targets this linear
        self.step = step

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out`, the base product of `x` (rows of the step), with each row's delta added."""
        for slot, rows in self.step.current.groups:
            if slot not in self.targeted:
                continue
            xs = (x if rows is None else x.index_select(0, rows)).to(self.a.dtype)
            delta = (xs @ self.a[slot].T) @ self.b[slot].T
            delta = delta.mul_(self.scalings[slot]).to(out.dtype)
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
        return out
