"""A linear's adapters add each row's own delta, `scaling * (x @ A^T) @ B^T`, whether its rows
come in a run of one adapter (a prefill: two matmuls of its own, added in place) or grouped
with other adapters' rows (a decode step: batched matmuls)."""

from __future__ import annotations

import pytest
import torch

from pagedbatch.engine.lora.linear import LoraLinear
from pagedbatch.engine.lora.mapping import BASE, CPU_MIN_RUN, LoraMapping, Run, StepMapping

IN, SIZES, RANK = 40, [24, 8, 8], 16  # a fused q/k/v linear
# float32 sums of 40 and 16 products of unit normals (deltas of tens), in any order
FLOAT32 = dict(rtol=1e-5, atol=1e-4)


def linear_with(ranks: dict[int, int], slots: int, targets: list[bool]) -> LoraLinear:
    """Slot s holds an adapter of rank `ranks[s]` (scaling 0.5 + s) on the parts `targets`."""
    gen = torch.Generator().manual_seed(0)
    linear = LoraLinear(["q", "k", "v"], SIZES, IN, slots, RANK, torch.zeros(1), StepMapping())
    for slot, r in ranks.items():
        pairs = [
            (torch.randn(r, IN, generator=gen), torch.randn(size, r, generator=gen))
            if targeted
            else None
            for size, targeted in zip(SIZES, targets, strict=True)
        ]
        linear.write(slot, pairs, 0.5 + slot)
    return linear


def each_rows_delta(linear: LoraLinear, x: torch.Tensor, out: torch.Tensor, row_slots):
    """What every row must come to, in float64, one row at a time."""
    expected = out.double().clone()
    for row, slot in enumerate(row_slots):
        if slot != BASE:
            a, b = linear.a[slot].double(), linear.b[slot].double()
            expected[row] += linear.scalings[slot].item() * (x[row].double() @ a.T @ b.T)
    return expected


# each sequence's (slot, rows): long runs, short ones, the base model's, neighbours of one slot
SEQUENCES = [(1, 19), (BASE, 5), (0, 3), (0, 14), (2, 1), (1, 1), (BASE, 20), (2, 40)]


def step(sequences) -> tuple[list[int], list[int], list[int]]:
    slots = [slot for slot, _ in sequences]
    starts = [0]
    for _, rows in sequences:
        starts.append(starts[-1] + rows)
    row_slots = [slot for slot, rows in sequences for _ in range(rows)]
    return slots, starts, row_slots


def test_a_run_is_one_adapters_consecutive_rows_neighbouring_sequences_joined():
    slots, starts, _ = step(SEQUENCES)
    m = LoraMapping.of(slots, starts, torch.device("cpu"), 3, min_run=CPU_MIN_RUN)
    # slot 0's 3 + 14 rows are one run of 17; slot 2's single row and slot 1's stay grouped
    assert m.runs == (Run(0, 19, 1), Run(24, 41, 0), Run(63, 103, 2))
    assert m.slots == (0, 1, 2)
    assert m.rows.tolist() == [42, 41]  # slot 1's row, then slot 2's, each group by slot
    assert LoraMapping.of(slots, starts, torch.device("cpu"), 3).runs == ()


@pytest.mark.parametrize("min_run", [None, 1, CPU_MIN_RUN, 1000])
def test_each_row_gets_its_own_adapters_delta_however_the_rows_are_laid_out(min_run):
    linear = linear_with({0: 8, 1: 16, 2: 4}, slots=3, targets=[True, False, True])
    slots, starts, row_slots = step(SEQUENCES)
    linear.step.current = LoraMapping.of(slots, starts, torch.device("cpu"), 3, min_run)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(row_slots), IN, generator=gen)
    base = torch.randn(len(row_slots), sum(SIZES), generator=gen)

    out = linear.add(x, base.clone())

    torch.testing.assert_close(out.double(), each_rows_delta(linear, x, base, row_slots), **FLOAT32)
    rows_of_base = [row for row, slot in enumerate(row_slots) if slot == BASE]
    assert torch.equal(out[rows_of_base], base[rows_of_base])


def test_a_run_of_an_adapter_that_skips_this_linear_leaves_its_rows():
    linear = linear_with({1: 8}, slots=3, targets=[True, True, True])  # slot 0 holds nothing
    slots, starts, row_slots = step([(0, 20), (1, 20)])
    linear.step.current = LoraMapping.of(slots, starts, torch.device("cpu"), 3, CPU_MIN_RUN)
    x, base = torch.randn(40, IN), torch.randn(40, sum(SIZES))

    out = linear.add(x, base.clone())

    assert torch.equal(out[:20], base[:20])
    torch.testing.assert_close(out.double(), each_rows_delta(linear, x, base, row_slots), **FLOAT32)
