"""Media as the engine takes them: images and audio clips whose encoder outputs fill a run of
placeholder tokens of the prompt.

A caller turns each image or clip into the values its encoder reads (multimodal/images.py,
multimodal/audio.py: transformers' processors for the model), off the engine thread: decoding and
resizing a large image, or computing a clip's spectrogram, takes tens of milliseconds that would
otherwise stall every request's decoding. Then `place` expands each placeholder token of the
prompt into the run its item's embeddings take the places of, and returns the `MediaItem`s that a
request carries. From there the engine treats every modality alike: the scheduler encodes an item
in the step that first reaches it, the encoder cache keeps its embeddings by content hash, and the
prefix cache's block hashes include the hashes of the items a block holds.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

Modality = Literal["image", "audio"]
Grid = tuple[int, int, int]  # an image's patches along time (frames), height and width


@dataclass(frozen=True, eq=False)
class ProcessedMedia:
    """An image or clip ready for the engine, before its place in a prompt is known."""

    modality: Modality
    token_id: int  # the placeholder token its embeddings take the places of
    values: torch.Tensor  # float32: an image's pixel values, a clip's log-mel features
    content_hash: bytes  # of what the encoder reads: one item's encoding, and KV, is shared
    num_tokens: int  # embeddings the encoder gives it
    grid: Grid | None = None  # a dynamic-resolution model's (Qwen2-VL's) patch grid
    frames: int = 0  # a clip's mel frames of sound; `values` may hold a few more, for context


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or clip of a request: what its encoder reads and the prompt positions its
    embeddings fill."""

    modality: Modality
    values: torch.Tensor
    content_hash: bytes
    offset: int  # the first placeholder's position in the prompt
    length: int  # placeholders, one per embedding the encoder gives
    grid: Grid | None = None
    frames: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


class MediaSpec(Protocol):
    """What a model reads of one modality."""

    modality: Modality
    token_id: int

    def tokens_for(self, item: MediaItem | ProcessedMedia) -> int:
        """The embeddings the item gives; ValueError if the model cannot read its values."""


def content_hash(modality: Modality, values: torch.Tensor, shape_of_content: object) -> bytes:
    """What an item is to its encoder: its values and what lays them out (an image's patch
    grid: a blank 4x8 and 8x4 have the same patches; a clip's frames of sound)."""
    h = hashlib.blake2b(digest_size=16, person=modality.encode())
    h.update(str((tuple(values.shape), shape_of_content)).encode())
    h.update(values.contiguous().numpy().tobytes())
    return h.digest()


def place(
    prompt_ids: list[int],
    media: Sequence[ProcessedMedia],
    placeholders: Collection[int] = (),
) -> tuple[list[int], list[MediaItem]]:
    """The prompt with each placeholder token expanded to its item's run, and the items in prompt
    order: the n-th placeholder of a modality takes the n-th item of it. ValueError unless the
    prompt holds exactly one placeholder per item, and none of the other `placeholders` (the
    model's, of modalities with no item here)."""
    wanted = Counter(m.token_id for m in media)
    for token_id in {*wanted, *placeholders}:
        found, count = prompt_ids.count(token_id), wanted[token_id]
        if found != count:
            raise ValueError(
                f"the prompt holds {found} placeholder tokens ({token_id}) for {count} items"
            )
    pending = {token_id: iter([m for m in media if m.token_id == token_id]) for token_id in wanted}
    ids: list[int] = []
    items: list[MediaItem] = []
    for token in prompt_ids:
        if token not in pending:
            ids.append(token)
            continue
        m = next(pending[token])
        items.append(
            MediaItem(
                m.modality, m.values, m.content_hash, len(ids), m.num_tokens, m.grid, m.frames
            )
        )
        ids.extend([token] * m.num_tokens)
    return ids, items


def media_tokens(items: Sequence[MediaItem], modality: Modality) -> int:
    """The prompt positions that items of `modality` fill."""
    return sum(item.length for item in items if item.modality == modality)
