"""Images as the engine takes them: pixel values that fill a run of placeholder tokens.

A caller turns each image into pixel values with `ImageProcessor` (transformers' image processor
for the model, on its PIL/numpy backend), off the engine thread: decoding and resizing a large
image takes tens of milliseconds that would otherwise stall every request's decoding. Then
`ImageProcessor.place` expands each image token of the prompt into the run of placeholders the
image's embeddings take the places of, and returns the `ImageItem`s that a request carries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedbatch.engine.config import ModelConfig


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a request: its pixel values and the prompt positions its embeddings fill."""

    pixel_values: torch.Tensor  # float32 [channels, height, width], as the vision tower reads
    content_hash: bytes  # of the pixel values: one image's encoding, and KV, is shared
    offset: int  # the first placeholder's position in the prompt
    length: int  # placeholders, one per embedding the encoder gives

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: the doors check these before decoding anything."""

    per_request: int
    bytes: int
    pixels: int
    allowed_hosts: tuple[str, ...] = ()  # whose http(s) URLs are fetched; lower case


@dataclass(frozen=True)
class ProcessedImage:
    """An image ready for the engine, before its place in a prompt is known."""

    pixel_values: torch.Tensor
    content_hash: bytes
    num_tokens: int


def content_hash(pixel_values: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"image")
    h.update(str(tuple(pixel_values.shape)).encode())
    h.update(pixel_values.contiguous().numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class ImageSpec:
    """What a vision-language model reads of an image."""

    token_id: int  # the placeholder token
    shape: tuple[int, int, int]  # of the pixel values: channels, height, width
    tokens: int  # embeddings per image, so placeholders per image


def image_spec(cfg: ModelConfig) -> ImageSpec | None:
    """None for a model without images. (LLaVA-1.5 resizes every image to one square.)"""
    top = cfg.multimodal
    if top is None or cfg.image_token_id is None:
        return None
    vision = top["vision_config"]
    side = vision["image_size"]
    patches = (side // vision["patch_size"]) ** 2
    full = top.get("vision_feature_select_strategy", "default") == "full"
    return ImageSpec(
        cfg.image_token_id, (vision.get("num_channels", 3), side, side), patches + int(full)
    )


class ImageProcessor:
    """A vision-language model's image preprocessing, safe to call from many threads."""

    def __init__(self, cfg: ModelConfig, limits: ImageLimits):
        from transformers import AutoImageProcessor  # only multimodal models need its imports

        spec = image_spec(cfg)
        if spec is None:
            raise ValueError(f"{cfg.architecture} takes no images")
        self.spec = spec
        self.limits = limits
        self._processor = AutoImageProcessor.from_pretrained(Path(cfg.metadata_dir))

    def __call__(self, image: Any) -> ProcessedImage:
        """A PIL image (any mode; converted to RGB) made ready for the engine."""
        pixels = self._processor(images=[image], return_tensors="np")["pixel_values"][0]
        pixel_values = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))
        return ProcessedImage(pixel_values, content_hash(pixel_values), self.spec.tokens)

    def place(
        self, prompt_ids: list[int], images: list[ProcessedImage]
    ) -> tuple[list[int], list[ImageItem]]:
        """The prompt with each image token expanded to its image's placeholders, and the
        items; ValueError unless the prompt holds exactly one image token per image."""
        image_token = self.spec.token_id
        found = prompt_ids.count(image_token)
        if found != len(images):
            raise ValueError(
                f"the prompt holds {found} image placeholder tokens for {len(images)} images"
            )
        ids: list[int] = []
        items: list[ImageItem] = []
        pending = iter(images)
        for token in prompt_ids:
            if token != image_token:
                ids.append(token)
                continue
            image = next(pending)
            items.append(
                ImageItem(image.pixel_values, image.content_hash, len(ids), image.num_tokens)
            )
            ids.extend([token] * image.num_tokens)
        return ids, items
