"""The token counts the penalties read, kept from step to step per request.

Rebuilding them every step would cost each penalised request its whole context, prompt and
output, converted from Python lists; kept, a step costs each one its new tokens. Each request
that asks for a penalty holds one row of two `[rows, vocab]` tensors on the logits' device:
`output` (how often each token occurs in its output, for the presence and frequency penalties)
and `seen` (whether each token occurs in its prompt or output, for the repetition penalty).

Invariants: a row belongs to one request object from its first use until `release`; once counted,
it covers exactly that request's prompt and first `counted` output tokens; a free row is all
zeros. The requests of one call have distinct ids (the engine's are unique), or are one object.
A request id met again with another object (an id reused after its request ended without a
release) gets its row cleared and recounted, never another's counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedbatch.engine.core.request import Request


@dataclass
class _Row:
    index: int
    request: Request
    counted: int | None = None  # output tokens in the counts; None: not even the prompt yet


class TokenCounts:
    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # [rows, vocab] float32
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []

    def rows(self, requests: Sequence[Request], vocab: int, device: torch.device) -> torch.Tensor:
        """The requests' row indices (int64, on `device`), each row first brought up to date."""
        if self.output is None or self.output.shape[1] != vocab or self.output.device != device:
            self._reset(vocab, device)
        indices, rows, tokens, output_rows, output_tokens = [], [], [], [], []
        for request in requests:
            row = self._row(request)
            indices.append(row.index)
            if row.counted is None:
                new_output = request.output_token_ids
                new_seen = request.all_token_ids
            else:
                new_output = new_seen = request.output_token_ids[row.counted :]
            output_rows += [row.index] * len(new_output)
            output_tokens += new_output
            rows += [row.index] * len(new_seen)
            tokens += new_seen
            row.counted = request.num_output_tokens
        if output_tokens:
            index = _index(output_rows, output_tokens, device)
            self.output.index_put_(index, torch.ones(len(output_tokens), device=device), True)
        if tokens:
            self.seen[_index(rows, tokens, device)] = True
        return torch.tensor(indices, device=device)

    # The tensors are made while sampling, under inference mode: only changed under it too.
    @torch.inference_mode()
    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._clear(row.index)
            self._free.append(row.index)

    def _row(self, request: Request) -> _Row:
        row = self._rows.get(request.request_id)
        if row is not None and row.request is not request:
            self._clear(row.index)
            row.request, row.counted = request, None
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[request.request_id] = _Row(self._free.pop(), request)
        return row

    def _clear(self, index: int) -> None:
        self.output[index] = 0.0
        self.seen[index] = False

    def _reset(self, vocab: int, device: torch.device) -> None:
        self.output = torch.zeros(0, vocab, device=device)
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._rows.clear()
        self._free.clear()

    def _grow(self) -> None:
        old = self.output.shape[0]
        new = max(8, 2 * old)
        vocab, device = self.output.shape[1], self.output.device
        self.output = torch.cat([self.output, torch.zeros(new - old, vocab, device=device)])
        extra = torch.zeros(new - old, vocab, dtype=torch.bool, device=device)
        self.seen = torch.cat([self.seen, extra])
        self._free = list(range(new - 1, old - 1, -1))


def _index(rows: list[int], tokens: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )
