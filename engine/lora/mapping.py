"""Which of a step's rows run with which adapter slot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BASE = -1  # the slot of a row that runs on the base model alone


@dataclass(frozen=True)
class LoraMapping:
    """Each slot present in a step with its rows (None: every row of the step)."""

    groups: tuple[tuple[int, torch.Tensor | None], ...] = ()

    @classmethod
    def of(
        cls, slots: Sequence[int], query_start_loc: Sequence[int], device: torch.device
    ) -> LoraMapping:
        """Sequence i runs with `slots[i]` (BASE: none) and owns rows
        `query_start_loc[i]:query_start_loc[i + 1]`."""
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), np.diff(query_start_loc))
        present = [int(s) for s in np.unique(per_row) if s != BASE]
        if len(present) == 1 and bool((per_row == present[0]).all()):
            return cls(((present[0], None),))
        return cls(
            tuple(
                (slot, torch.from_numpy(np.flatnonzero(per_row == slot)).to(device))
                for slot in present
            )
        )


class StepMapping:
    """The running step's mapping, set once a step and read by every adapted linear."""

    def __init__(self) -> None:
        self.current = LoraMapping()
