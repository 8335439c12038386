"""Greedy tokens without a step's whole logits: the vocabulary taken a slice at a time.

A step whose every sampled row is plain greedy (no logprobs, nothing that edits its logits) needs
each row's largest logit alone. The logits, rows x vocabulary in float32, are the step's largest
tensor where the vocabulary is large: 128 sequences of Gemma 3's 262,144 tokens take 128 MiB,
half the model's quantized weights, made and dropped every step. Taken in slices of at most
`SLICE_BYTES`, each slice's best kept, they take a slice's worth; the LM head's weights are
still read once a step (each slice reads its own rows of them), and the tokens equal the whole
row's argmax, the lowest id of ties, a NaN first where there is one (numpy's argmax).

Where the LM head offers a cheaper product with a bound on its error (`Screen`: a quantized
head's bf16 product on AMX, int8 elsewhere, for many rows), each slice is taken that way
instead, and only the tokens whose approximate logit is within the bounds of their row's best,
its candidates (one or two a row mostly; tens of thousands in a few of Gemma 3's first steps,
taken a part at a time), get exact logits: the same argmax for a fraction of the exact
product's time. Gemma 3's 262,144-token head at 128 rows on a 2-core
AMD EPYC (AVX512-BF16, no AMX): 160-200 ms against the float32 tiles' 360-700; its 128 chats
went from 143 to 221 output tokens/s. Picking the candidates out of a slice is
`greedy_screen.candidates`' two passes in C: on a Zen 4 EPYC the screened head took 152-157 ms
a step, the bf16 product 137 of them, against 204 with torch's eight elementwise passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pagedbatch.kernels import greedy_screen

SLICE_BYTES = 8 * 2**20
# A slice's width rounds down to this many tokens: whole tiles of the products' kernels.
SLICE_ALIGN = 256
# What a part of a screened step's candidates may take: their weight rows (at most float32's
# bytes) and their exact and masked logits for the rows that have some among them. Early in
# Gemma 3's chats a step had tens of thousands of candidates; parts a slice wide took 39 MiB of
# temporaries at 128 rows (16,384 blocks of 680 bytes, two 8 MiB products), raising the step's
# peak RSS by as much.
CANDIDATE_PART_BYTES = 4 * 2**20

# compute_logits(hidden, vocab): the float logits of the token ids `vocab` selects.
LogitsOf = Callable[[torch.Tensor, slice], torch.Tensor]


class Screen(Protocol):
    """The LM head's weight where it has a cheaper approximate product (`QuantizedWeight`)."""

    def approximates(self, x: torch.Tensor) -> bool:
        """Whether `approximate` runs, and pays, for the rows of x."""
        ...

    def approximate(
        self, x: torch.Tensor, part: slice, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits of the ids `part` selects, approximate (written into `out` where given)."""
        ...

    def error_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(margin `[rows]`, norms `[vocabulary]`): an approximate logit [i, j] is within
        margin[i] * norms[j] of the exact one."""
        ...

    def rows_product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact logits of the token ids `ids` (int64)."""
        ...


def argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first of ties (int64). numpy's is several
    times faster than torch's on CPU."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def greedy_tokens(
    hidden: torch.Tensor,
    logits_of: LogitsOf,
    vocab_size: int | None,
    screen: Screen | None = None,
) -> torch.Tensor:
    """The argmax over the vocabulary of each row of `hidden`'s logits (int64 `[rows]`), made
    in slices where the whole would exceed `SLICE_BYTES`; in one piece where `vocab_size` is
    None (a head that cannot take part of the vocabulary); screened where `screen` approximates
    these rows (see the top)."""
    rows = hidden.shape[0]
    if (
        screen is not None
        and vocab_size is not None
        and screen.approximates(hidden)
        and bool(hidden.isfinite().all())  # else every approximate logit is NaN
    ):
        return _screened(hidden, screen, vocab_size)
    width = SLICE_BYTES // (4 * max(rows, 1)) // SLICE_ALIGN * SLICE_ALIGN
    if vocab_size is None or width == 0 or width >= vocab_size:
        return argmax(logits_of(hidden, slice(None)).float())
    best_values, best_ids = _best(logits_of(hidden, slice(0, width)))
    for start in range(width, vocab_size, width):
        values, ids = _best(logits_of(hidden, slice(start, start + width)))
        # Strictly greater: an earlier slice keeps its ties. A NaN wins over any number.
        better = (values > best_values) | (values.isnan() & ~best_values.isnan())
        best_ids = torch.where(better, ids + start, best_ids)
        best_values = torch.where(better, values, best_values)
    return best_ids


def _best(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value of a slice of logits and its index in the slice."""
    logits = logits.float()
    ids = argmax(logits)
    return logits.gather(1, ids[:, None]).squeeze(1), ids


def _screened(hidden: torch.Tensor, screen: Screen, vocab_size: int) -> torch.Tensor:
    """Each row's argmax from its candidates' exact logits: the tokens whose approximate logit
    plus its bound reaches the row's floor, the largest approximate logit less its bound, which
    the row's exact best reaches too (`greedy_screen.candidates`, a slice at a time). A token
    whose approximate logit is NaN (a weight row that is) is a candidate."""
    rows = hidden.shape[0]
    width = max(SLICE_ALIGN, SLICE_BYTES // (4 * rows) // SLICE_ALIGN * SLICE_ALIGN)
    floor = torch.full((rows,), -torch.inf)
    margin, norms = screen.error_bound(hidden)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (row, id, upper)
    # Made once: a slice's tensor made anew each slice, the small ones kept in `found` would
    # split its freed chunks, and the heap grew by most of a slice's size every slice.
    buffer = torch.empty(rows * width)
    for start in range(0, vocab_size, width):
        part = slice(start, min(start + width, vocab_size))
        values = buffer[: rows * (part.stop - start)].view(rows, -1)
        approx = screen.approximate(hidden, part, out=values)
        found.append(greedy_screen.candidates(approx, margin, norms[part], floor, start))
    row, ids, upper = (torch.cat(parts) for parts in zip(*found, strict=True))
    keep = upper >= floor[row]  # against the final floors: earlier slices saw lower ones
    row, ids = row[keep], ids[keep]
    candidates, column = torch.unique(ids, return_inverse=True)  # sorted: ties go to the lowest
    # The candidates' exact logits a part at a time (`CANDIDATE_PART_BYTES`), each for the rows
    # that have some among them: early in Gemma 3's chats a few rows' bounds left 50,000-94,000
    # candidates in a step, whose exact logits for every row took 48 MiB and their blocks 64 more.
    best_values = torch.full((rows,), -torch.inf)
    best_ids = candidates[:1].repeat(rows)  # where a row's logits are all -inf: as argmax
    part_width = max(1, CANDIDATE_PART_BYTES // (4 * (hidden.shape[1] + 2 * rows)))
    for start in range(0, len(candidates), part_width):
        part = candidates[start : start + part_width]
        inside = (column >= start) & (column < start + len(part))
        at, part_row = torch.unique(row[inside], return_inverse=True)
        exact = screen.rows_product(hidden[at], part)
        masked = torch.full_like(exact, -torch.inf)
        masked[part_row, column[inside] - start] = exact[part_row, column[inside] - start]
        values, index = _best(masked)
        # As `greedy_tokens`' slices: an earlier part keeps its ties, a NaN wins over a number.
        held = best_values[at]
        better = (values > held) | (values.isnan() & ~held.isnan())
        best_ids[at] = torch.where(better, part[index], best_ids[at])
        best_values[at] = torch.where(better, values, held)
    return best_ids
