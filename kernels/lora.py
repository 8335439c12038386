"""LoRA deltas added to a linear's product, each row with its own adapter: the torch path (the
CPU path, and the reference `triton_lora.py` is tested against), same signature.

A step's rows come grouped by adapter slot, as `engine.lora.mapping.LoraMapping` lays them out:
`groups` groups of `width` positions each, position p reading step row `gather[p]` (a group's
rows first, then padding); `valid` are the real positions, in order, and `rows` the step rows
they add to (so `rows` lists the rows group by group). Group g runs with the adapter in slot
`subset[g]` (`subset` None: slot g).
"""

from __future__ import annotations

from collections.abc import Iterable

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
    shrunk = torch.bmm(xs, a.transpose(1, 2))
    if valid.numel() < gather.numel():
        # Padding positions read row 0: their deltas zeroed (exactly), they add nothing to it.
        keep = torch.zeros(gather.numel(), 1, dtype=shrunk.dtype, device=shrunk.device)
        shrunk.mul_(keep.index_fill_(0, valid, 1).view(a.shape[0], width, 1))
    delta = torch.bmm(shrunk, b.transpose(1, 2)).mul_(scalings)
    return out.index_add_(0, gather, delta.view(-1, delta.shape[-1]).to(out.dtype))


def add_lora_runs(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scalings: torch.Tensor,
    runs: Iterable[tuple[int, int, int]],
) -> torch.Tensor:
    """`out` with `scaling_s * (x @ A_s^T) @ B_s^T` added to rows `start:end` for each run
    (start, end, slot s), by two matmuls a run, the second accumulating into those rows of `out`
    in place, scaled as it adds (as peft scales the product, after B). Operands as in
    `add_lora`; returns `out`. Reads each scaling to the host: for CPU tensors."""
    for start, end, slot in runs:
        shrunk = torch.mm(x[start:end].to(a.dtype), a[slot].t()).to(out.dtype)
        out[start:end].addmm_(shrunk, b[slot].t().to(out.dtype), alpha=float(scalings[slot]))
    return out
