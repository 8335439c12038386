"""LoRA deltas added to a linear's product, each row with its own adapter: the torch path (the
CPU path, and the reference `triton_lora.py` is tested against), same signature.

A step's rows come grouped by adapter slot, as `engine.lora.mapping.LoraMapping` lays them out:
`groups` groups of `width` positions each, position p reading step row `gather[p]` (a group's
rows first, then padding); `valid` are the real positions, in order, and `rows` the step rows
they add to (so `rows` lists the rows group by group). Group g runs with the adapter in slot
`subset[g]` (`subset` None: slot g).
"""

from __future__ import annotations

import torch


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scalings: torch.Tensor,
    gather: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    subset: torch.Tensor | None,
) -> torch.Tensor:
    """`out` (the base product of `x` `[rows, in]`) with `scaling_s * (x @ A_s^T) @ B_s^T` added
    to each row of a group of slot s; A `[slots, r, in]`, B `[slots, out, r]`, scalings
    `[slots, 1, 1]`, all in one dtype. Returns `out`, changed in place.

    Every group is one batch of a batched matmul: a pair of bmm calls serves every adapter
    present, whatever their count."""
    if subset is not None:
        a, b, scalings = a[subset], b[subset], scalings[subset]
    xs = x.index_select(0, gather).view(a.shape[0], width, -1).to(a.dtype)
    delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)).mul_(scalings)
    delta = delta.view(-1, delta.shape[-1]).index_select(0, valid)
    return out.index_add_(0, rows, delta.to(out.dtype))
