"""Images for a vision-language model: what it reads of one (`ImageSpec`), the processor that
makes a PIL image ready for it, and Qwen2-VL's M-RoPE positions over a prompt's image grids."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.inputs import (
    Grid,
    MediaItem,
    Modality,
    ProcessedMedia,
    content_hash,
)


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: the doors check these before decoding anything."""

    per_request: int
    bytes: int
    pixels: int
    allowed_hosts: tuple[str, ...] = ()  # whose http(s) URLs are fetched; lower case
    fetch_seconds: float = 10.0  # all of a request's fetches together


@dataclass(frozen=True)
class ImageSpec:
    """What a vision-language model reads of an image: one fixed shape (LLaVA-1.5 resizes every
    image to one square), or rows of patches on a grid of the image's own size (Qwen2-VL)."""

    token_id: int  # the placeholder token
    shape: tuple[int, int, int] | None = None  # fixed: channels, height, width
    tokens: int = 0  # fixed: embeddings per image
    patch_values: int = 0  # grid: values per patch row (channels x frames x patch x patch)
    merge: int = 1  # grid: patches merged into one embedding along each side
    mrope: bool = False  # positions along time, height and width (Qwen2-VL's M-RoPE)
    modality: Modality = "image"

    def tokens_for(self, item: MediaItem | ProcessedMedia) -> int:
        pixel_values, grid = item.values, item.grid
        if not isinstance(pixel_values, torch.Tensor):
            raise ValueError("pixel values must be a tensor")
        shape = tuple(pixel_values.shape)
        if self.shape is not None:
            if shape != self.shape:
                raise ValueError(f"pixel values of shape {shape}; the model reads {self.shape}")
            return self.tokens
        m = self.merge
        if (
            grid is None
            or len(grid) != 3
            or any(not isinstance(n, int) or n < 1 for n in grid)
            or grid[1] % m
            or grid[2] % m
        ):
            raise ValueError(f"a grid of (frames, height, width) patches, sides multiples of {m}")
        patches = grid[0] * grid[1] * grid[2]
        if shape != (patches, self.patch_values):
            raise ValueError(
                f"pixel values of shape {shape}; grid {grid} needs {(patches, self.patch_values)}"
            )
        return patches // (m * m)


def image_spec(cfg: ModelConfig) -> ImageSpec | None:
    """None for a model without images."""
    top = cfg.multimodal
    token = cfg.image_token_id
    if top is None or token is None:
        return None
    vision = top["vision_config"]
    if cfg.architecture == "Qwen2VLForConditionalGeneration":
        patch = vision.get("patch_size", 14)
        values = vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2) * patch * patch
        merge = vision.get("spatial_merge_size", 2)
        return ImageSpec(token, patch_values=values, merge=merge, mrope=True)
    side = vision["image_size"]
    patches = (side // vision["patch_size"]) ** 2
    full = top.get("vision_feature_select_strategy", "default") == "full"
    return ImageSpec(token, (vision.get("num_channels", 3), side, side), patches + int(full))


def mrope_positions(
    prompt_len: int, images: Sequence[MediaItem], merge: int
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's M-RoPE positions of a prompt, `[3, prompt_len]` (time, height, width), and the
    delta that later tokens' positions add to their index, as transformers' `get_rope_index`:
    text counts up on all three; an image's embeddings sit on its grid, from where the text
    before it left off, and the text after goes on from past the grid's longer side."""
    columns = []
    index = position = 0
    for item in images:
        text = item.offset - index
        columns.append(np.broadcast_to(np.arange(position, position + text), (3, text)))
        position += text
        frames, height, width = item.grid[0], item.grid[1] // merge, item.grid[2] // merge
        t, h, w = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
        columns.append(np.stack([t, h, w]).reshape(3, -1) + position)
        position += max(height, width)
        index = item.end
    text = prompt_len - index
    columns.append(np.broadcast_to(np.arange(position, position + text), (3, text)))
    table = np.concatenate(columns, axis=1).astype(np.int64)
    return table, int(table.max()) + 1 - prompt_len


# The longest side of an image over its shortest: Qwen2-VL's processor refuses more, as vLLM
# does; and a processor that scales the shortest side to a fixed length (CLIP's) would make a
# strip of 1,048,576x16 pixels, inside the pixel limit, into billions of pixels.
MAX_ASPECT_RATIO = 200


class ImageRefused(ValueError):
    """An image this model's processor cannot take (its shape, or the processor failed on it):
    the client's image is at fault. `code` is the error code to answer with."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ImageProcessor:
    """A vision-language model's image preprocessing, safe to call from many threads.

    An image's shape is checked before the model's processor runs: its aspect ratio at most
    MAX_ASPECT_RATIO, and the size the processor would resize it to at most the pixel limit of
    an image as sent, so that preprocessing holds no more pixels than decoding did. Whatever
    then goes wrong in the processor is the image's ImageRefused too.
    """

    def __init__(self, cfg: ModelConfig, limits: ImageLimits):
        from transformers import AutoImageProcessor  # only multimodal models need its imports

        spec = image_spec(cfg)
        if spec is None:
            raise ValueError(f"{cfg.architecture} takes no images")
        self.spec = spec
        self.limits = limits
        self._processor = AutoImageProcessor.from_pretrained(Path(cfg.metadata_dir))

    def refusal(self, width: int, height: int) -> ImageRefused | None:
        """Why the processor may not take an image of `width` x `height` pixels, or None."""
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            return ImageRefused(
                f"The image is {width}x{height} pixels: one side is more than {MAX_ASPECT_RATIO} "
                "times the other, more than a model reads",
                "invalid_image_shape",
            )
        resized = self.resized_size(width, height)
        if resized is not None and resized[0] * resized[1] > self.limits.pixels:
            return ImageRefused(
                f"The image is too large: {width}x{height} pixels would be resized to "
                f"{resized[0]}x{resized[1]} for this model, more than the {self.limits.pixels} "
                "pixels allowed",
                "image_too_large",
            )
        return None

    def resized_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) of the image the processor resizes one of this size to; None for a
        processor whose resizing is not known here (the aspect ratio bounds it then)."""
        processor = self._processor
        size = getattr(processor, "size", None)
        if size is None or not getattr(processor, "do_resize", True):
            return width, height
        if getattr(processor, "merge_size", None):  # Qwen2-VL: a pixel budget on a grid
            # The processor's own module's (transformers has one for each backend).
            smart_resize = importlib.import_module(type(processor).__module__).smart_resize
            factor = processor.patch_size * processor.merge_size
            h, w = smart_resize(
                height, width, factor, _size(size, "shortest_edge"), _size(size, "longest_edge")
            )
            return w, h
        if (side := _size(size, "shortest_edge")) is not None:  # CLIP: the shorter side to it
            short, long = sorted((width, height))
            longer = int(side * long / short)
            return (side, longer) if width <= height else (longer, side)
        if (h := _size(size, "height")) is not None and (w := _size(size, "width")) is not None:
            return w, h
        return None

    def __call__(self, image: Any) -> ProcessedMedia:
        """A PIL image (any mode; converted to RGB) made ready for the engine; ImageRefused if
        the model cannot take it."""
        if (refused := self.refusal(*image.size)) is not None:
            raise refused
        try:
            out = self._processor(images=[image], return_tensors="np")
        except Exception as e:  # noqa: BLE001 - whatever the processor trips on is the image's
            raise ImageRefused(
                f"The model's image processor could not read the image ({type(e).__name__}: {e})",
                "invalid_image_format",
            ) from None
        grid: Grid | None = None
        if "image_grid_thw" in out:  # one image's patch rows, on its grid
            grid = tuple(int(n) for n in out["image_grid_thw"][0])
            pixels = out["pixel_values"]
        else:
            pixels = out["pixel_values"][0]
        values = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))
        processed = ProcessedMedia(
            "image", self.spec.token_id, values, content_hash("image", values, grid), 0, grid
        )
        return replace(processed, num_tokens=self.spec.tokens_for(processed))


def _size(size: Any, name: str) -> int | None:
    """A field of an image processor's `size` (a SizeDict, or a dict in older processors)."""
    return size.get(name) if isinstance(size, dict) else getattr(size, name, None)
