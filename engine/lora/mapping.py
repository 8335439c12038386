"""Which of a step's rows run with which adapter slot, laid out for batched matmuls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

BASE = -1  # the slot of a row that runs on the base model alone

# On the CPU, rows of one adapter this many or more in a row (a prefill) take two matmuls of
# their own, the second adding into the product's rows in place, scaled as it adds: one pass
# over them, where the grouped layout's delta, its scaling and scatter make three. On
# bench-small-llama, 128 requests over 8 rank-16 adapters, the adapters' cost fell from 1.46x
# the base model's time to 1.35x with runs (benchmarks/lora.py). On CUDA the Triton kernels add
# in place already.
CPU_MIN_RUN = 16


class Run(NamedTuple):
    """Rows `start:end` of the step, all with the adapter in `slot`."""

    start: int
    end: int
    slot: int


@dataclass(frozen=True)
class LoraMapping:
    """The slots present in a step (`slots`), their rows either in `runs` or grouped: each
    grouped slot given `width` positions (its rows, then padding, so that every slot's rows are
    one batch of a batched matmul). `gather` is the step row each position reads (padding reads
    row 0); the positions `valid` are real rows, and `rows` the step rows they add to. No row
    grouped: `gather` is None."""

    slots: tuple[int, ...] = ()
    runs: tuple[Run, ...] = ()
    width: int = 0
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    # The grouped slots' indices where they are not all the resident ones (None: all, in order).
    subset: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        slots: Sequence[int],
        query_start_loc: Sequence[int],
        device: torch.device,
        resident: int,
        min_run: int | None = None,
    ) -> LoraMapping:
        """Sequence i runs with `slots[i]` (BASE: none) and owns rows
        `query_start_loc[i]:query_start_loc[i + 1]`; `resident` slots are served. Consecutive
        rows of one slot, at least `min_run` of them (None: never), are a run; the rest are
        grouped."""
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), np.diff(query_start_loc))
        runs = _runs(per_row, min_run) if min_run is not None and per_row.size else ()
        for run in runs:
            per_row[run.start : run.end] = BASE
        grouped = [int(s) for s in np.unique(per_row) if s != BASE]
        present = tuple(sorted({*grouped, *(run.slot for run in runs)}))
        if not grouped:
            return cls(present, runs)
        groups = [np.flatnonzero(per_row == slot) for slot in grouped]
        width = max(len(g) for g in groups)
        gather = np.zeros((len(groups), width), dtype=np.int64)
        for i, group in enumerate(groups):
            gather[i, : len(group)] = group
        valid = np.concatenate([i * width + np.arange(len(g)) for i, g in enumerate(groups)])
        rows = np.concatenate(groups)
        subset = None if grouped == list(range(resident)) else torch.tensor(grouped)

        def to(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            present,
            runs,
            width,
            to(gather.reshape(-1)),
            to(valid),
            to(rows),
            None if subset is None else subset.to(device),
        )


def _runs(per_row: np.ndarray, min_run: int) -> tuple[Run, ...]:
    """The stretches of at least `min_run` rows of one adapter's slot in `per_row`."""
    edges = np.flatnonzero(np.diff(per_row)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(per_row)]])
    return tuple(
        Run(int(start), int(end), int(per_row[start]))
        for start, end in zip(starts, ends, strict=True)
        if per_row[start] != BASE and end - start >= min_run
    )


class StepMapping:
    """The running step's mapping, set once a step and read by every adapted linear."""

    def __init__(self) -> None:
        self.current = LoraMapping()
