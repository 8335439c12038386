"""Block tables kept from step to step: one row of block ids per request holding blocks.

A step's block tables are then one gather of the scheduled requests' rows, however long their
contexts, instead of lists rebuilt and padded every step; a request's row changes only where it
gains blocks, as vLLM's BlockTable does.

Invariants: a request holding blocks owns exactly one row; the row's first `num_blocks[row]`
entries are its block ids in order and the rest are 0 (the padding a step's table gets); a
released row is all 0 and is handed to the next request that needs one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    def __init__(self, rows: int = 64, width: int = 64):
        self._ids = np.zeros((rows, width), dtype=np.int32)
        self._num_blocks = np.zeros(rows, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest first

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Add blocks at the end of the request's row, taking a row if it has none."""
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * len(self._num_blocks))
            row = self._row_of[request_id] = self._free_rows.pop()
        start = int(self._num_blocks[row])
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            self._grow(width=max(end, 2 * self._ids.shape[1]))
        self._ids[row, start:end] = block_ids
        self._num_blocks[row] = end

    def release(self, request_id: str) -> None:
        """Give up the request's row, if it has one."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        self._ids[row, : self._num_blocks[row]] = 0
        self._num_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, request_ids: Sequence[str]) -> np.ndarray:
        """The requests' rows, in order, cut to the widest of them: `[len(request_ids), width]`
        int32, padded with 0. Every request must hold blocks."""
        rows = np.fromiter(
            (self._row_of[r] for r in request_ids), dtype=np.intp, count=len(request_ids)
        )
        width = int(self._num_blocks[rows].max())
        return self._ids[rows, :width]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self._ids.shape
        rows, width = rows or old_rows, width or old_width
        ids = np.zeros((rows, width), dtype=np.int32)
        ids[:old_rows, :old_width] = self._ids
        self._ids = ids
        if rows > old_rows:
            extra = np.zeros(rows - old_rows, dtype=np.int64)
            self._num_blocks = np.concatenate([self._num_blocks, extra])
            self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows
