"""The tokens of a slice of approximate logits that may be their row's greedy token: the rule of
a screened greedy step (engine/sample/greedy.py), in C (greedy_screen.c) where the kernels are
built, in torch elsewhere and as the reference the C is checked against."""

from __future__ import annotations

import torch

from pagedbatch.kernels import native

# Room for a slice's candidates before it is counted: a few a row covers nearly every slice, and
# one that has more is written on a second call with room for all.
ROOM_PER_ROW = 4


def candidates(
    approx: torch.Tensor,
    margin: torch.Tensor,
    norms: torch.Tensor,
    floor: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of approx `[rows, width]` (float32, contiguous, on the CPU), whose [r, c] is within
    margin[r] * norms[c] of the exact logit of token start + c: raises each floor[r] (in place)
    to the row's largest lower bound approx - margin norm here (NaN left out), and returns the
    tokens whose upper bound approx + margin norm reaches it, as (row, token id) int64 pairs
    with that upper bound (float32; +inf where it is NaN), in row order."""
    lib = native.library()
    if lib is None:
        return _candidates_torch(approx, margin, norms, floor, start)
    rows, width = approx.shape
    capacity = ROOM_PER_ROW * rows
    while True:
        row = torch.empty(capacity, dtype=torch.int64)
        ids = torch.empty(capacity, dtype=torch.int64)
        upper = torch.empty(capacity)
        count = lib.screen_candidates(
            approx.data_ptr(), rows, width, margin.data_ptr(), norms.data_ptr(),
            floor.data_ptr(), start, capacity,
            row.data_ptr(), ids.data_ptr(), upper.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if count < 0:
            raise MemoryError("screen_candidates could not allocate its counts")
        if count <= capacity:
            return row[:count], ids[:count], upper[:count]
        capacity = count


def _candidates_torch(
    approx: torch.Tensor,
    margin: torch.Tensor,
    norms: torch.Tensor,
    floor: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bound = margin[:, None] * norms
    lower = torch.sub(approx, bound).nan_to_num_(nan=-torch.inf).amax(dim=1)
    torch.maximum(floor, lower, out=floor)
    upper = bound.add_(approx).nan_to_num_(nan=torch.inf)
    row, col = (upper >= floor[:, None]).nonzero(as_tuple=True)
    return row, col + start, upper[row, col]
