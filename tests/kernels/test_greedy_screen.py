"""A screened greedy step's candidates in a slice: the C kernel's floors and candidates are the
torch reference's, whatever the slice holds and however many candidates it has."""

from __future__ import annotations

import pytest
import torch
from test_quant_matmul import needs_compiler

from pagedbatch.kernels import greedy_screen, native

pytestmark = needs_compiler


def slice_of(rows: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    approx = torch.randn(rows, width, generator=generator) * 3
    margin = torch.rand(rows, generator=generator) * 0.1
    norms = torch.rand(width, generator=generator) * 4
    return approx, margin, norms


def both(approx, margin, norms, floor, start):
    """The C kernel's and the reference's candidates and floors, each from the same floors."""
    assert native.library() is not None, "the C kernels did not build; see the warning"
    c_floor, t_floor = floor.clone(), floor.clone()
    c = greedy_screen.candidates(approx, margin, norms, c_floor, start)
    t = greedy_screen._candidates_torch(approx, margin, norms, t_floor, start)
    return c, c_floor, t, t_floor


@pytest.mark.parametrize(("rows", "width"), [(1, 1), (9, 1000), (128, 4096), (13, 257)])
def test_the_kernel_finds_the_references_candidates_and_floors(rows, width):
    approx, margin, norms = slice_of(rows, width, seed=rows)
    floor = torch.full((rows,), -torch.inf)
    floor[0] = 2.0  # an earlier slice's
    (row, ids, upper), c_floor, (t_row, t_ids, t_upper), t_floor = both(
        approx, margin, norms, floor, start=5000
    )
    torch.testing.assert_close(c_floor, t_floor)
    assert torch.equal(row, t_row) and torch.equal(ids, t_ids)
    torch.testing.assert_close(upper, t_upper)
    assert bool((ids >= 5000).all()) and bool((ids < 5000 + width).all())


def test_nan_is_no_floor_and_always_a_candidate():
    approx, margin, norms = slice_of(4, 300, seed=1)
    approx[1, 7] = float("nan")
    approx[2] = float("nan")  # a whole row: its floor stays where it was
    floor = torch.full((4,), -torch.inf)
    (row, ids, upper), c_floor, (t_row, t_ids, _), t_floor = both(approx, margin, norms, floor, 0)
    assert torch.equal(row, t_row) and torch.equal(ids, t_ids)
    assert c_floor[2] == -torch.inf and torch.equal(c_floor, t_floor)
    assert (1, 7) in zip(row.tolist(), ids.tolist(), strict=True)
    assert bool((upper[row == 2] == torch.inf).all()) and int((row == 2).sum()) == 300


def test_a_slice_of_more_candidates_than_the_first_room_gives_them_all():
    rows, width = 6, 2000
    approx = torch.zeros(rows, width)  # every token ties: all are candidates
    margin, norms = torch.full((rows,), 0.5), torch.ones(width)
    floor = torch.full((rows,), -torch.inf)
    assert rows * width > greedy_screen.ROOM_PER_ROW * rows
    (row, ids, upper), c_floor, (t_row, t_ids, _), _ = both(approx, margin, norms, floor, 10)
    assert len(row) == rows * width
    assert torch.equal(row, t_row) and torch.equal(ids, t_ids)
    assert bool((c_floor == -0.5).all()) and bool((upper == 0.5).all())
