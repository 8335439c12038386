"""Greedy tokens without a step's whole logits: the vocabulary taken a slice at a time.

A step whose every sampled row is plain greedy (no logprobs, nothing that edits its logits) needs
each row's largest logit alone. The logits, rows x vocabulary in float32, are the step's largest
tensor where the vocabulary is large: 128 sequences of Gemma 3's 262,144 tokens take 128 MiB,
half the model's quantized weights, made and dropped every step. Taken in slices of at most
`SLICE_BYTES`, each slice's best kept, they take a slice's worth; the LM head's weights are
still read once a step (each slice reads its own rows of them), and the tokens equal the whole
row's argmax, the lowest id of ties, a NaN first where there is one (numpy's argmax).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SLICE_BYTES = 8 * 2**20
# A slice's width rounds down to this many tokens: whole tiles of the products' kernels.
SLICE_ALIGN = 256

# compute_logits(hidden, vocab): the float logits of the token ids `vocab` selects.
LogitsOf = Callable[[torch.Tensor, slice], torch.Tensor]


def argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first of ties (int64). numpy's is several
    times faster than torch's on CPU."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def greedy_tokens(
    hidden: torch.Tensor, logits_of: LogitsOf, vocab_size: int | None
) -> torch.Tensor:
    """The argmax over the vocabulary of each row of `hidden`'s logits (int64 `[rows]`), made
    in slices where the whole would exceed `SLICE_BYTES`; in one piece where `vocab_size` is
    None (a head that cannot take part of the vocabulary)."""
    rows = hidden.shape[0]
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
