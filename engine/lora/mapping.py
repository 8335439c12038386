"""Which of a step's rows run with which adapter slot, laid out for batched matmuls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BASE = -1  # the slot of a row that runs on the base model alone


@dataclass(frozen=True)
class LoraMapping:
    """The slots present in a step, each given `width` positions (its rows, then padding, so
    that every slot's rows are one batch of a batched matmul). `gather` is the step row each
    position reads (padding reads row 0); the positions `valid` are real rows, and `rows` the
    step rows they add to. No slot present: `slots` is empty."""

    slots: tuple[int, ...] = ()
    width: int = 0
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    # The slots' indices where they are not all the resident ones (None: all, in order).
    subset: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        slots: Sequence[int],
        query_start_loc: Sequence[int],
        device: torch.device,
        resident: int,
    ) -> LoraMapping:
        """Sequence i runs with `slots[i]` (BASE: none) and owns rows
        `query_start_loc[i]:query_start_loc[i + 1]`; `resident` slots are served."""
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), np.diff(query_start_loc))
        present = [int(s) for s in np.unique(per_row) if s != BASE]
        if not present:
            return cls()
        groups = [np.flatnonzero(per_row == slot) for slot in present]
        width = max(len(g) for g in groups)
        gather = np.zeros((len(groups), width), dtype=np.int64)
        for i, group in enumerate(groups):
            gather[i, : len(group)] = group
        valid = np.concatenate([i * width + np.arange(len(g)) for i, g in enumerate(groups)])
        rows = np.concatenate(groups)
        subset = None if present == list(range(resident)) else torch.tensor(present)

        def to(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            tuple(present),
            width,
            to(gather.reshape(-1)),
            to(valid),
            to(rows),
            None if subset is None else subset.to(device),
        )


class StepMapping:
    """The running step's mapping, set once a step and read by every adapted linear."""

    def __init__(self) -> None:
        self.current = LoraMapping()
